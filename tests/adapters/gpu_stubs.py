"""The SGLang adapter tests' GPU stubs: ``pdkv.testing.gpu_stubs`` (``pdkv bench sglang`` uses them too)."""

from pdkv.testing.gpu_stubs import GPU_ONLY, calls, calls_outside_import, install

__all__ = ["GPU_ONLY", "calls", "calls_outside_import", "install"]
