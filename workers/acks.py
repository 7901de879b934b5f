"""Acknowledging a served sub-batch, guarded by the instance's fence, in the reply transaction.

A worker answers a sub-batch in one MULTI/EXEC: the replies, then the acks
(the sub-batch out of its queue, its requests out of the request stream),
the dispatcher's wake-up token and the instance's batch counter. None of it
may happen once a dispatcher has taken the instance for dead and set its
fence (:mod:`dispatcher.reclaiming`): the requests are another instance's
by then, and an XACK here would acknowledge entries the dispatcher has
claimed back.

The worker used to WATCH the fence, read it, then EXEC: three round trips
to Redis per sub-batch, 0.25 ms of the 0.94 ms its finish took at B=8
(small payloads, this project's 2-core host). Now every write of the
transaction checks the fence itself, in a script: the reply scripts take it
as their guard (:func:`packrat_mq.replies.queue`) and :data:`_ACK` below
does the rest. Inside EXEC nothing runs between the scripts, so they all
see the same fence: a transaction writes everything or, fenced, nothing,
and says which. One round trip, and a fence set at any moment before the
EXEC is seen (with WATCH, any moment after the WATCH; a fence set while
the batch ran was seen either way).

Every key here is one model's, so the script is single-slot on Redis
Cluster too (:mod:`packrat_mq.keys`); the replies there are written before
the transaction (:mod:`packrat_mq.replies`), after the worker has checked
the fence once more.
"""
from __future__ import annotations

from typing import Any

from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP, Keys
from packrat_mq.records import InstanceState

#: Cap on the dispatcher's wake-up list; tokens only say "look again".
WAKEUP_CAP = 64
#: The instance record's counter of answered sub-batches.
_BATCHES = "batches"
assert _BATCHES in InstanceState.COUNTERS

#: KEYS: fence, instance queue, request stream, wake-up list, instance record.
#: ARGV: worker group, dispatcher group, queue entry id, instance id, wake-up cap, counter, request ids...
#: Returns {0} when the fence is set (nothing written), else {1, errors...}: like EXEC, a command that
#: fails (a consumer group lost to a Redis restart) is reported and the others still run. The request
#: ids go a thousand at a time: Lua's unpack stops near 8,000 values, and a sub-batch may be larger.
_ACK = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0} end
local result = {1}
local function call(...)
  local res = redis.pcall(...)
  if type(res) == 'table' and res.err then result[#result + 1] = res.err end
end
call('XACK', KEYS[2], ARGV[1], ARGV[3])
call('XDEL', KEYS[2], ARGV[3])
for i = 7, #ARGV, 1000 do
  local last = math.min(i + 999, #ARGV)
  call('XACK', KEYS[3], ARGV[2], unpack(ARGV, i, last))
  call('XDEL', KEYS[3], unpack(ARGV, i, last))
end
call('LPUSH', KEYS[4], ARGV[4])
call('LTRIM', KEYS[4], 0, tonumber(ARGV[5]) - 1)
call('HINCRBY', KEYS[5], ARGV[6], 1)
return result
"""


def queue_ack(pipe: Any, keys: Keys, model: str, instance_id: str, entry_id: bytes,
              request_ids: list[str]) -> None:
    """Queue the guarded acknowledgement of sub-batch ``entry_id`` and its requests on ``pipe``.

    Its result in the transaction is read by :func:`outcome`. EVAL, not EVALSHA, for the reason
    :mod:`packrat_mq.replies` gives: a script missing from the server's cache
    would fail inside EXEC.
    """
    script_keys = [keys.fence(model, instance_id), keys.queue(model, instance_id), keys.requests(model),
                   keys.wakeup(model), keys.instance(model, instance_id)]
    args = [WORKER_GROUP, DISPATCHER_GROUP, entry_id, instance_id, WAKEUP_CAP, _BATCHES, *request_ids]
    pipe.execute_command("EVAL", _ACK, len(script_keys), *script_keys, *args)


def outcome(result: Any) -> tuple[bool, list[str]]:
    """(whether the acknowledgement ran, the errors of its commands) from its result in the transaction.

    False: the instance is fenced and nothing was written. A failed script
    (an error in place of the result) counts as ran, with that error: EXEC
    has applied the rest of the transaction, replies included, as it
    would have after a failed XACK before.
    """
    if isinstance(result, Exception):
        return True, [str(result)]
    if not result or int(result[0]) == 0:
        return False, []
    return True, [e.decode() if isinstance(e, bytes) else str(e) for e in result[1:]]
