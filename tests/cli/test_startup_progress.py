"""A slow start is seen, not silent: while `pdserve serve` waits for its deployment, every few
seconds it says what each child last wrote (loading, compiling, warming up)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.commands.child_logs import ChildLogs
from pdserve.commands.launcher import wait_healthy


def test_the_starting_line_names_each_child_and_its_last_line(tmp_path):
    logs = ChildLogs(tmp_path)
    assert logs.starting_line(3.2) == "pdserve: starting (3 s): no output yet"
    logs.path("router").write_text("INFO waiting for nodes\n\n")
    logs.path("decode-0").write_text(
        "2026-12-05 17:18:31,121 INFO pdserve.engine.runner.model_runner: dtype float32\n"
        "2026-12-05 17:18:36,358 INFO pdserve.engine.runner.model_runner: building the "
        "compiled CPU decode paths (the first start...)\n"
    )
    logs.path("prefill-0").write_text("")
    assert logs.starting_line(20.4) == (
        "pdserve: starting (20 s): decode-0: building the compiled CPU decode paths "
        "(the first start...); router: INFO waiting for nodes"
    )


class _Health(BaseHTTPRequestHandler):
    ready = threading.Event()

    def do_GET(self):
        self.send_response(200 if self.ready.is_set() else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_waiting_reports_progress_until_the_deployment_answers():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    waited: list[float] = []

    def progress(seconds: float) -> None:
        waited.append(seconds)
        if len(waited) == 3:  # ready only after the third report
            _Health.ready.set()

    try:
        wait_healthy(url, lambda: False, 120, progress=progress, progress_every_s=0.05)
        assert len(waited) == 3 and waited == sorted(waited) and waited[0] >= 0.05
        waited.clear()
        wait_healthy(url, lambda: False, 120, progress=progress, progress_every_s=30)
        assert waited == []  # ready at once: nothing to report
    finally:
        server.shutdown()
        _Health.ready.clear()
