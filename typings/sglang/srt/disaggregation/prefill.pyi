# Only the name the plugin's hook must rebind (imported here with ``from ... import get_kv_class``).
from sglang.srt.disaggregation.utils import get_kv_class as get_kv_class
