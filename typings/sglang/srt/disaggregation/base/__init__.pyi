from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer as BaseKVBootstrapServer,
)
from sglang.srt.disaggregation.base.conn import BaseKVManager as BaseKVManager
from sglang.srt.disaggregation.base.conn import BaseKVReceiver as BaseKVReceiver
from sglang.srt.disaggregation.base.conn import BaseKVSender as BaseKVSender
from sglang.srt.disaggregation.base.conn import KVArgs as KVArgs
from sglang.srt.disaggregation.base.conn import KVPoll as KVPoll
