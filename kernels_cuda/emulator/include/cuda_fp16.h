// cuda_fp16.h of the CUDA emulator: __half and __half2 come with cuda_emu.h.
#pragma once
#include "cuda_emu.h"
