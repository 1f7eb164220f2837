"""Model runners behind one protocol (base.py): the reference cpu_runner.py, the CUDA gpu_runner.py, the
transformers-backed hf_runner.py; the paged KV cache, the sampler and the Triton kernels they share."""
