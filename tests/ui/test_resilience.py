"""Nothing is lost when the process dies mid-reply; the GUI thread never stalls on the model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.storage import ChatStore
from app.ui.qt import QTimer

ROOT = Path(__file__).resolve().parents[2]


def test_a_reply_cut_by_killing_the_process_is_there_after_restart(open_window,
                                                                    embedded_model_path, tmp_path):
    data = tmp_path / "data"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, str(ROOT / "tests/ui/streaming_child.py"), str(data),
                              str(embedded_model_path)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        saved = ""
        while time.monotonic() < deadline and len(saved) < 400:
            time.sleep(0.3)
            if not (data / "ferrox.sqlite3").exists():
                continue
            with ChatStore(data) as store:
                chats = store.list_chats()
                path = store.active_path(chats[0].id) if chats else []
                if len(path) == 2 and path[1].status == "streaming":
                    saved = path[1].content
        assert len(saved) >= 40, child.stdout.read() if child.poll() is not None else "no text saved"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    _assert_saved_at_least_twice_a_second(child.stdout.read())
    driver = open_window(data)  # the restart
    chat = driver.store.list_chats()[0]
    user, reply = driver.path(chat.id)
    assert user.content == "Tell me a very long story about a lighthouse."
    assert reply.status == "interrupted"
    assert reply.content.startswith(saved)  # everything seen before the kill, maybe a bit more
    driver.window.controller.show_chat(chat.id)
    widget = driver.window.message_view.message_widget(reply.id)
    assert widget is not None


def _assert_saved_at_least_twice_a_second(log: str) -> None:
    """The README: a streaming reply is saved at least twice a second. The child logs each
    save; every save must carry new text, and the gaps between saves stay near the 250 ms
    beat (median), with a generous bound on the longest one for a loaded machine."""
    saves = [(float(t), int(n)) for t, n in re.findall(r"^saved ([\d.]+) (\d+)$", log, re.MULTILINE)]
    assert len(saves) >= 6, log[-2000:]
    lengths = [n for _, n in saves]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)  # only changed text
    gaps = sorted(b - a for (a, _), (b, _) in zip(saves, saves[1:]))
    median = gaps[len(gaps) // 2]
    print(f"\n[save gaps] {len(gaps)} gaps: median {median * 1000:.0f} ms, "
          f"longest {gaps[-1] * 1000:.0f} ms")
    assert median <= 0.4, gaps
    assert gaps[-1] <= 2.0, gaps


class Heartbeat:
    """A 5 ms timer on the GUI thread; the longest gap between its ticks is the longest stall."""

    def __init__(self, probe=lambda: None):
        self.last = time.perf_counter()
        self.longest = 0.0
        self.probe = probe
        self.worst = None  # what `probe` said at the longest gap
        self.timer = QTimer(interval=5)
        self.timer.timeout.connect(self.beat)

    def beat(self):
        now = time.perf_counter()
        if now - self.last > self.longest:
            self.longest, self.worst = now - self.last, self.probe()
        self.last = now

    def start(self):
        self.last = time.perf_counter()
        self.longest = 0.0
        self.timer.start()

    def stop_ms(self) -> float:
        self.timer.stop()
        return self.longest * 1000


def test_gui_thread_stall_while_streaming_and_prefilling(driver, tmp_path, capsys):
    controller = driver.controller

    def state():
        reply = controller.replies.for_chat(controller.current_chat_id)
        return (reply.state, reply.tokens) if reply else None

    heartbeat = Heartbeat(state)
    driver.set_max_tokens(60)
    heartbeat.start()
    driver.type_and_send("Tell me about the sea")
    reply = controller.replies.for_chat(controller.current_chat_id)
    driver.qtbot.waitUntil(lambda: reply.tokens >= 40, timeout=120_000)
    streaming_ms, streaming_at = heartbeat.stop_ms(), heartbeat.worst
    driver.wait_until_idle()

    document = tmp_path / "long.txt"
    document.write_text("The committee reviewed the quarterly figures for every region. " * 260)
    controller.new_chat()
    controller.add_files([str(document)])
    chat = controller.current_chat_id
    driver.qtbot.waitUntil(lambda: bool(controller.pending.get(chat)
                                        and controller.pending[chat][0].tokens), timeout=30_000)
    tokens = controller.pending[chat][0].tokens
    driver.set_max_tokens(4)
    heartbeat.start()
    driver.type_and_send("Summarise")
    driver.wait_until_idle()
    prefill_ms = heartbeat.stop_ms()
    assert tokens > 2500 and driver.path()[-1].status == "complete"
    with capsys.disabled():
        print(f"\n[GUI stall] longest gap while streaming: {streaming_ms:.0f} ms "
              f"(at {streaming_at}); "
              f"while prefilling a {tokens:,}-token document: {prefill_ms:.0f} ms")
