"""The peak memory of a training step does not grow with the number of no-grad steps
(n = 4, 16, 64: growth <= 10%), measured in fresh processes and printed. A control run with full backprop shows
that the measurement does see growth when activations are stored."""
from benchmarks.loop_memory import measure


def test_step_memory_flat_in_no_grad_steps():
    rows = measure([4, 16, 64], k=2, d=192, seq=192, batch=8)
    base = rows[0]["step_peak_mb"]
    for r in rows:
        print(f"n={r['n']:>3} k=2: step peak {r['step_peak_mb']:.1f} MB ({r['step_peak_mb'] / base - 1:+.1%})")
    assert base > 20, "the step must allocate measurably"
    assert max(r["step_peak_mb"] for r in rows) <= 1.10 * base

    full = measure([16], k=2, d=192, seq=192, batch=8, truncate=False)[0]["step_peak_mb"]
    print(f"control, n=16 with full backprop: {full:.1f} MB")
    assert full > 2.0 * rows[1]["step_peak_mb"], "storing all 18 steps must cost clearly more"
