"""The chief of ``test_answer_fuzz.py``: asks a hostile worker for closures' answers and
decodes each one as the coordinator does, in this child process (a crash is its exit signal).

Reads ``FUZZ_ADDRESS``, ``FUZZ_CALLS`` and ``JAXDIST_COORDINATOR_TOKEN`` (TLS from the
``JAXDIST_TLS_*`` environment). For every answer: ``answer_value`` (a result) or
``remote_exception`` (an error), exactly the functions ``WorkerThread._settle`` calls, then
uses what came back (repr, sums of arrays). Prints one JSON line of counts: ``decoded``,
``refused`` (``UntrustedPickleError`` naming the worker, or a ``RemoteError`` whose encoded
form was refused or absent), ``hostile_decoded`` (answers the worker marked as carrying a forbidden
construct that were not refused) and ``other`` (any other exception: a bug).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from jaxdist._src.coordinator import answer_codec
from jaxdist._src.coordinator.errors import RemoteError
from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.coordinator.worker_service import answer_value, to_bytes_array
from jaxdist._src.coordinator.worker_thread import remote_exception

BATCH = 64
SENDER = "worker:0"


def _use(value) -> None:
    """Touches what the chief built, as a user's code would."""
    repr(value)[:200]
    if isinstance(value, np.ndarray) and value.size < 1 << 16:
        value.tolist()
        if value.dtype.kind in "biufc":
            np.sum(value)
    elif isinstance(value, (dict, list, tuple, set, frozenset)):
        len(value)


def main() -> int:
    client = WorkerClient([os.environ["FUZZ_ADDRESS"]], direct_transport=False)
    counts = {"decoded": 0, "refused": 0, "hostile": 0, "hostile_decoded": 0, "other": 0,
              "answers": 0}
    examples: list[str] = []
    request = ({"closures": [{"closure_id": i} for i in range(BATCH)], "group": BATCH},
               {f"args.{i}": to_bytes_array(b"") for i in range(BATCH)})
    for _ in range(int(os.environ["FUZZ_CALLS"])):
        for meta, arrays in client.call_stream(0, "RunClosures", *request, timeout=60):
            counts["answers"] += 1
            hostile = bool(meta.get("fuzz_hostile"))
            counts["hostile"] += hostile
            try:
                if meta.get("ok"):
                    value = answer_value(arrays, SENDER)
                else:
                    value = remote_exception(meta, arrays, SENDER)
                    if isinstance(value, RemoteError):  # nothing of the worker's was built
                        assert value.task == SENDER, value.task
                        counts["refused"] += 1
                        continue
                _use(value)
            except answer_codec.UntrustedPickleError as e:
                assert SENDER in str(e), str(e)
                counts["refused"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - counted: the test fails on any
                counts["other"] += 1
                if len(examples) < 5:
                    examples.append(f"{type(e).__name__}: {str(e)[:200]}")
                continue
            counts["decoded"] += 1
            if hostile:
                counts["hostile_decoded"] += 1
                if len(examples) < 5:
                    examples.append(f"hostile answer decoded: {repr(value)[:200]}")
    client.close()
    print(json.dumps({**counts, "examples": examples}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
