"""What makes every family's tower fast, shared by all of them: the attention kernel's choice and
its packed forms (`attention`), fused LayerNorm / GELU / rotary ops (`fused`), compiled blocks
(`compiled`), FP8 Linears (`fp8`), and the context values they read while a forward runs
(`scoped`). A family's adapter installs them on its tower; none knows a family."""
