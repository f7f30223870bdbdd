"""Multi-process tests on CPU with gloo, run through ``sbpflow.testing`` pools."""
