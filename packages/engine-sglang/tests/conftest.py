"""Tests of the sglang engine plugin. The CPU tests need no SGLang (they run over
ferryman_engine_sglang.testing.FakeSGLangEngine); test_gpu.py needs SGLang and a GPU."""
