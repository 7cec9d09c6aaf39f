"""Why a generation ended: the one vocabulary the verifier's events, the gateway and the
converters share (no torch, no protobuf).

The wire carries them as ``dflash.v1.FinishReason`` (``dflash.core.convert.FINISH`` is the one table
between the two); OpenAI's names for them are the gateway's (``gateway.openai_convert``).

* ``FINISH_LENGTH``: ``max_tokens`` reached (or the context window's room).
* ``FINISH_STOP``: a stop token (EOS or ``stop_token_ids``), or the gateway's stop string.
* ``FINISH_CANCELLED``: the client went away or the request was cancelled.
"""

from typing import Final

FINISH_LENGTH: Final = "length"
FINISH_STOP: Final = "stop"
FINISH_CANCELLED: Final = "cancelled"
#: Every finish reason an event may carry (a last event's ``finish``; None before the last).
FINISH_REASONS: Final = (FINISH_LENGTH, FINISH_STOP, FINISH_CANCELLED)
