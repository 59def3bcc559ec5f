"""What makes every family's tower fast, shared by all of them: the attention kernel's choice and
its packed and dense forms (`attention`, `cudnn_packed`, `dense_cudnn`), fused rotary / patch GEMM /
GELU-epilogue / RMSNorm ops (`fused`, one module each, switched by `fused_switch`), compiled blocks
(`compiled`), FP8 Linears (`fp8`), and the context values they read while a forward runs
(`scoped`). A family's adapter installs them on its tower; none knows a family."""
