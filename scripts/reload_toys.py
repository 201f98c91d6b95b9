"""The two toy models of scripts/model_reload_check.py: decoupled Python-backend models that send a few
responses half a second apart, then a FINAL: ``inline`` from ``execute()``, ``threaded`` from a background
thread (as this repository's engine host answers), written into a model repository of their own."""

from __future__ import annotations

from pathlib import Path

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

# Both toys send RESPONSES responses PAUSE_S apart, then an empty FINAL.
COMMON = """import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

RESPONSES = 4
PAUSE_S = 0.5


def answer(request):
    sender = request.get_response_sender()
    x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
    for i in range(RESPONSES):
        time.sleep(PAUSE_S)
        out = pb_utils.Tensor("Y", np.array([int(x[0]) * 100 + i], dtype=np.int32))
        sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

INLINE = (
    COMMON
    + """

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:  # answered from execute(): it returns once every request is final
            answer(request)
        return None
"""
)

THREADED = (
    COMMON
    + """

class TritonPythonModel:
    def initialize(self, args):
        self.work = queue.Queue()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while True:
            request = self.work.get()
            if request is None:
                return
            answer(request)  # answered from this thread: execute() has long returned

    def execute(self, requests):
        for request in requests:
            self.work.put(request)
        return None

    def finalize(self):
        self.work.put(None)
        self.thread.join(timeout=5)
"""
)


def write_repository(root: Path) -> Path:
    repo = root / "models"
    for name, source in (("inline", INLINE), ("threaded", THREADED)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
        (repo / name / "1" / "model.py").write_text(source)
    return repo
