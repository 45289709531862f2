"""How fast is it? Per-stage timing, traces, the bench against PyTorch and the bandwidth roofline."""
