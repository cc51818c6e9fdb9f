"""The AdamW arithmetic on the CPU: torch references (exact, lean), the fused native kernel, which
one runs, the fp32 master split into bf16 + int16, and the learning-rate schedules."""
