"""Kernel lab: per-target schedules and kernels (installed as ``dsv2_mlc.schedules``)."""
