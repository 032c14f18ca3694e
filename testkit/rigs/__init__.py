"""End-to-end rigs that play kubelet and the endpoints controller against the API emulator and the real operator.

`base` holds what they share (`EmulatedDeployment`), `slices` the EndpointSlice builder, `scale_from_zero`
the scale-from-zero rig (tests/operator_e2e/test_scale_from_zero.py, benchmarks/autoscaling/cold_start.py).
"""
