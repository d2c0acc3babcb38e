"""Custom Relax passes of dsv2-mlc (installed as ``dsv2_mlc.passes``)."""
