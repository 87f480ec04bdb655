"""Images in: the mmproj file, preprocessing, one module per projector, as libmtmd does it.

Layout (each module one job):
- chunk.py: ImageChunk, what an encoded image hands the text side;
- mmproj.py: reading and checking an mmproj GGUF (`clip.*` keys), picking the projector;
- image_io.py: decoding an image (Pillow) under a pixel budget;
- image_ops.py: resize, pad and normalize as libmtmd computes them;
- vit.py: the ViT encoder blocks shared by the projectors; activation.py: their MLP activations;
- encoder_ops.py: the encoders' heavy ops behind one object, the CPU's by default;
  gpu_encoder.py: the same ops in VRAM (with GPU text layers, unless --no-mmproj-offload);
- patch_attention.py: non-causal attention over the patches, spread over the threads;
- gemma3.py, gemma4v.py, qwen3vl.py: one projector each (its preprocessing and graph);
  gemma4v_encoder.py: Gemma 4's own vision tower (2-D RoPE, RMS-normed blocks), gemma4v's.
"""
