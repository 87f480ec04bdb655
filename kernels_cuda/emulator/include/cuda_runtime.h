// cuda_runtime.h of the CUDA emulator.
#pragma once
#include "cuda_emu.h"
