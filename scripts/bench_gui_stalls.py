"""How long the GUI thread stalls while chats stream, documents are read and chats open.

Headless (QT_QPA_PLATFORM=offscreen), the real main window on the real default built-in model
(SmolLM2 135M Instruct), its own temporary data folder. A 10 ms heartbeat timer on the GUI
thread records the gap between its ticks: a gap over 10 ms is time the GUI thread spent on
something else (or waited for the GIL). Four scenarios:

  a  one chat streams (the send included); its reply's tok/s is printed too
  b  two chats stream while a ~3,000-token document is dropped on a third chat, counted and
     prefilled (sends, chat switches and the drop included)
  c  a 200-message chat is opened (seeded in SQLite through app.storage)
  d  the app relaunches into a long chat (200 messages, ~4,000 tokens), then a follow-up is
     sent in it; the heartbeat starts at the new window's first frame (before it nothing is
     on screen): the time to build the window and to its first frame are reported beside it

Before a-c the engine's background kernel-policy measurement (which starts after a second of
idleness and takes every core) is waited for, so they measure their own work; d keeps the
re-check a relaunch runs.

    .venv/bin/python scripts/bench_gui_stalls.py                # all four
    .venv/bin/python scripts/bench_gui_stalls.py --only a,c     # some
    .venv/bin/python scripts/bench_gui_stalls.py --profile      # + where the GUI thread's time went
    .venv/bin/python scripts/bench_gui_stalls.py --probe        # + who held the GIL (no cProfile)

--profile runs cProfile on the GUI thread only (the worker and engine threads are not
profiled) and times every event Qt delivers on it, printing the slowest events and the
functions with the most cumulative time per scenario; a probe thread that sleeps 1 ms in a
loop prints, for each time it woke late, where every thread was (a worker holding the GIL
in a long C call stalls the GUI thread as surely as its own work). Profiling slows the GUI
thread down: read its gaps as attribution, not as the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("FERROX_WEIGHT_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.ui.qt import QtCore, QtWidgets, QTimer  # noqa: E402

HEARTBEAT_MS = 10
LONG_GAP_MS = 50
SHOWN_GAP_MS = 20  # gaps over the p99 goal are printed (the five longest) with their phase
DOC_SENTENCE = "The committee reviewed the quarterly figures for every region. "
CACHE = Path(os.environ.get("FERROX_BENCH_CACHE", Path(tempfile.gettempdir()) / "ferrox-bench"))


# ---- measuring ------------------------------------------------------------------------

class Heartbeat:
    """A 10 ms precise timer on the GUI thread; `gaps` are the times between its ticks."""

    def __init__(self):
        self.timer = QTimer(interval=HEARTBEAT_MS)
        self.timer.setTimerType(QtCore.Qt.TimerType.PreciseTimer)
        self.timer.timeout.connect(self._beat)
        self.gaps: list[float] = []  # ms
        self._phase = ""
        self._phases = [""]  # every phase since the previous tick: what a gap spanned
        self.long: list[tuple[float, str]] = []
        self._last = 0.0

    @property
    def phase(self) -> str:
        """What the scenario is doing, named with the longest gaps."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self._phases.append(value)

    def start(self) -> None:
        self.gaps, self.long = [], []
        self._last = time.perf_counter()
        self._phases = [self._phase]
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def _beat(self) -> None:
        now = time.perf_counter()
        gap = (now - self._last) * 1000
        self._last = now
        self.gaps.append(gap)
        if gap > SHOWN_GAP_MS:
            self.long.append((gap, " -> ".join(p for p in dict.fromkeys(self._phases) if p)))
        self._phases = [self._phase]


class GilProbe:
    """With --profile: a Python thread that sleeps 1 ms in a loop. When it wakes more than
    PROBE_GAP_MS late, some thread held the GIL (or the CPU was taken): it records every
    thread's innermost frames at that moment, which name who was running through the gap
    (the holder is usually just past the long call)."""

    PROBE_GAP_MS = 20

    def __init__(self, heartbeat: Heartbeat):
        self.heartbeat = heartbeat
        self.gaps: list[tuple[float, str, list[str]]] = []  # (ms, phase, one line a thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        names = {}
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gap = (now - last) * 1000
            if gap > self.PROBE_GAP_MS:
                frames = sys._current_frames()
                names.update({t.ident: t.name for t in threading.enumerate()})
                lines = [f"{names.get(ident, ident)}: {self._where(frame)}"
                         for ident, frame in frames.items() if ident != me]
                self.gaps.append((gap, self.heartbeat.phase, lines))
            last = time.perf_counter()

    @staticmethod
    def _where(frame) -> str:
        """The innermost three frames, innermost last (paths cut to the project or package)."""
        stack = traceback.extract_stack(frame)[-3:]
        return " > ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in stack)

    def text(self) -> str:
        out = []
        for gap, phase, lines in sorted(self.gaps, reverse=True)[:12]:
            out.append(f"  probe gap {gap:6.1f} ms during {phase}")
            out.extend(f"      {line}" for line in lines)
        return "\n".join(out) or "  none"


def _short(filename: str) -> str:
    """A path from the project's root or from site-packages."""
    for marker in ("site-packages/", f"{Path(__file__).resolve().parents[1]}/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename.rsplit("/", 1)[-1]


class FirstPaint(QtCore.QObject):
    """Notes when top-level `widget` is first painted (its first UpdateRequest, which paints
    the window; the flag is read once that event is handled): the window's first frame.
    Until then nothing is on screen to stutter; the time it takes is reported (first frame
    ms) beside the time to build the window, and the heartbeat starts after it."""

    def __init__(self, widget: QtWidgets.QWidget):
        super().__init__()
        self.widget, self.done = widget, False
        widget.installEventFilter(self)

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 (Qt's name)
        if event.type() == QtCore.QEvent.Type.UpdateRequest:
            self.done = True
        return False

    def remove(self) -> None:
        self.widget.removeEventFilter(self)


class EventTimer(QtWidgets.QApplication):
    """With --profile: times every event delivered on the GUI thread (receiver, type)."""

    timing = False
    slowest: list[tuple[float, str]] = []

    def notify(self, receiver, event) -> bool:  # noqa: N802 (Qt's name)
        if not self.timing:
            return super().notify(receiver, event)
        kind, event_type = type(receiver).__name__, event.type()
        started = time.perf_counter()
        try:
            return super().notify(receiver, event)
        finally:
            spent = (time.perf_counter() - started) * 1000
            if spent > 8:
                try:
                    name = receiver.objectName()
                except RuntimeError:  # the event deleted its receiver
                    name = "deleted"
                self.slowest.append((spent, f"{kind}({name}) {event_type.name}"))


def wait_until(condition, timeout_s: float = 300.0, poll_ms: int = 20) -> None:
    """Run the event loop until `condition()` holds."""
    loop = QtCore.QEventLoop()
    poll = QTimer(interval=poll_ms)
    deadline = time.monotonic() + timeout_s

    def check():
        if condition() or time.monotonic() > deadline:
            loop.quit()

    poll.timeout.connect(check)
    poll.start()
    if not condition():
        loop.exec()
    poll.stop()
    if not condition():
        raise TimeoutError(f"gave up after {timeout_s:.0f} s")


def idle(seconds: float) -> None:
    """Run the event loop for `seconds` (the layout and painting a step leaves behind)."""
    end = time.monotonic() + seconds
    wait_until(lambda: time.monotonic() >= end, seconds + 5)


def summary(gaps: list[float]) -> dict:
    ordered = sorted(gaps) or [0.0]

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {"beats": len(gaps), "p50": statistics.median(ordered), "p99": pct(99),
            "max": ordered[-1], "over50": sum(g > LONG_GAP_MS for g in gaps)}


def cpu_class() -> str:
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), "?")
    except (OSError, subprocess.SubprocessError):
        pass
    import torch

    return (f"{model}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}; "
            f"{os.cpu_count()} logical CPUs")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- driving the window ---------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.data = Path(tempfile.mkdtemp(prefix="ferrox-gui-bench-"))
        # The engine's background kernel tuning reads the data folder from the environment.
        os.environ["FERROX_DATA_DIR"] = str(self.data)
        self.alerts: list[tuple[str, str]] = []
        self.model = self._model_path()
        self.window = None
        self.heartbeat: Heartbeat | None = None
        self.results: list[tuple[str, dict, list]] = []
        self.profiles: dict[str, str] = {}

    @staticmethod
    def _model_path() -> Path:
        from app.models.embedded import ensure_default_model

        return ensure_default_model(CACHE / "models")

    def open_window(self):
        from app.main import create_main_window

        policy = CACHE / "kernel_policy.json"  # the CPU kernel measurement, kept across runs
        if policy.exists() and not (self.data / "kernel_policy.json").exists():
            shutil.copyfile(policy, self.data / "kernel_policy.json")
        started = time.perf_counter()
        window = create_main_window(["--data-dir", str(self.data), "--model", str(self.model)])
        built_ms = (time.perf_counter() - started) * 1000
        window.resize(1100, 760)
        self.window, self.controller = window, window.controller
        # A modal box would block the run: alerts are recorded and printed instead.
        self.controller._alert = lambda title, text: self.alerts.append((title, text))
        self.controller._confirm = lambda title, text: True
        started = time.perf_counter()
        painted = FirstPaint(window)
        window.show()
        wait_until(lambda: painted.done, 60, poll_ms=1)
        painted.remove()
        return built_ms, (time.perf_counter() - started) * 1000

    def wait_for_model(self):
        c = self.controller
        wait_until(lambda: c.model_info is not None or bool(c.model_error))
        if c.model_info is None:
            raise SystemExit(f"the model did not load: {c.model_error}")
        policy = self.data / "kernel_policy.json"
        if policy.exists() and not (CACHE / "kernel_policy.json").exists():
            shutil.copyfile(policy, CACHE / "kernel_policy.json")

    def close_window(self):
        self.window.close()
        idle(0.2)
        self.window.deleteLater()
        self.window = None
        idle(0.5)  # the old window's widgets are destroyed before anything is measured

    def send(self, text: str, max_tokens: int) -> int:
        c = self.controller
        c.store.update_chat_settings(c.current_chat_id, {"max_tokens": max_tokens,
                                                        "temperature": 0})
        self.window.composer.set_text(text)
        self.window.findChild(QtWidgets.QWidget, "sendButton").click()
        return c.current_chat_id

    def open_chat(self, chat_id: int):
        chat_list = self.window.chat_list
        chat_list.setCurrentItem(chat_list.item_for(chat_id))

    def idle_all(self):
        wait_until(lambda: len(self.controller.replies) == 0)

    # ---- scenarios ---------------------------------------------------------------------

    def measure(self, name: str, run) -> None:
        beat = self.heartbeat = Heartbeat()
        profiler = cProfile.Profile() if self.args.profile else None
        probe = GilProbe(beat) if self.args.profile or self.args.probe else None
        app = QtWidgets.QApplication.instance()
        EventTimer.slowest = []
        if probe:
            probe.start()
        if profiler:
            app.timing = True
            profiler.enable()
        beat.start()
        extra = run(beat) or {}
        beat.stop()
        if profiler:
            profiler.disable()
            app.timing = False
        if probe:
            probe.stop()
        if profiler or probe:
            self.profiles[name] = ((self._profile_text(profiler) if profiler else "")
                                   + f"\nGIL probe (1 ms sleeper, gaps > {probe.PROBE_GAP_MS} ms):\n"
                                   + probe.text())
        self.results.append((name, {**summary(beat.gaps), **extra}, sorted(beat.long)[-5:]))
        self.print_result(*self.results[-1])

    @staticmethod
    def _profile_text(profiler: cProfile.Profile) -> str:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("cumulative").print_stats(r"app/|PySide6|message_view|sqlite", 35)
        stats.sort_stats("tottime").print_stats(20)
        slow = sorted(EventTimer.slowest, reverse=True)[:15]
        events = "\n".join(f"  {ms:7.1f} ms  {what}" for ms, what in slow)
        return f"slowest GUI-thread events:\n{events}\n{out.getvalue()}"

    def scenario_a(self, beat: Heartbeat):
        beat.phase = "send"
        self.controller.new_chat()
        idle(0.3)
        chat = self.send("Tell me about the sea and the ships that sail on it.", 160)
        beat.phase = "stream"
        self.idle_all()
        beat.phase = "after"
        idle(0.3)
        return {"tokens": self._reply_tokens(chat), "tok/s": self._reply_rate(chat)}

    def scenario_b(self, beat: Heartbeat):
        c = self.controller
        document = self.data / "report.txt"
        document.write_text(DOC_SENTENCE * 300)
        beat.phase = "send A"
        c.new_chat()
        self.send("Write a short story about a lighthouse keeper.", 200)
        beat.phase = "send B"
        c.new_chat()
        self.send("Explain how bread rises, step by step.", 200)
        beat.phase = "drop document"
        c.new_chat()
        doc_chat = c.current_chat_id
        c.add_files([str(document)])
        wait_until(lambda: bool(c.pending.get(doc_chat) and c.pending[doc_chat][0].tokens))
        tokens = c.pending[doc_chat][0].tokens
        beat.phase = "send document"
        self.send("Summarise the report in one sentence.", 24)
        beat.phase = "switch chats"
        for chat in list(c.replies.all())[:2]:
            self.open_chat(chat.chat_id)
            idle(0.4)
        beat.phase = "stream + prefill"
        self.idle_all()
        beat.phase = "after"
        idle(0.3)
        return {"doc tokens": tokens}

    def seed_long_chat(self, messages: int, words: int, title: str) -> int:
        """A chat of `messages` alternating turns straight into SQLite (no model involved)."""
        store = self.controller.store
        chat = store.create_chat(title)
        with store.transaction():
            for i in range(messages):
                role = "user" if i % 2 == 0 else "assistant"
                store.add_message(chat.id, role, seed_text(i, words))
        return chat.id

    def scenario_c(self, beat: Heartbeat, chat_id: int):
        beat.phase = "open"
        self.controller.refresh_chat_list()
        self.open_chat(chat_id)
        beat.phase = "after open"
        idle(1.0)
        beat.phase = "scroll to top"
        bar = self.window.message_view.verticalScrollBar()
        for _ in range(40):  # a person scrolling up through the history
            bar.setValue(max(0, bar.value() - 600))
            idle(0.03)
        beat.phase = "after scroll"
        idle(0.5)
        # How far building older messages got while measured (the rest are built after).
        return {"messages": len(self.controller.store.active_path(chat_id)),
                "built": self.window.message_view.built_count()}

    def scenario_d(self, beat: Heartbeat, shown: tuple[float, float], chat_id: int):
        beat.phase = "relaunched: load model"
        self.wait_for_model()
        c = self.controller
        beat.phase = "after load"
        idle(1.0)
        beat.phase = "send in long chat"
        self.send("And what should I do next?", 40)
        beat.phase = "prefill + stream"
        self.idle_all()
        beat.phase = "after"
        idle(0.3)
        last = c.store.active_path(chat_id)[-1]
        return {"window built ms": shown[0], "first frame ms": shown[1],
                "prompt tokens": (last.metadata or {}).get("prompt_tokens", 0)}

    def _reply_tokens(self, chat_id: int) -> int:
        last = self.controller.store.active_path(chat_id)[-1]
        return (last.metadata or {}).get("completion_tokens", 0)

    def _reply_rate(self, chat_id: int) -> float:
        """The reply's decode rate as the window shows it: with the GUI, the bridge and the
        engine on their own threads, to hold beside `bench`'s decode figure (one thread
        drives everything there). Until 2026-12-05 it was half of it: app/openmp.py."""
        last = self.controller.store.active_path(chat_id)[-1]
        return (last.metadata or {}).get("tokens_per_s", 0.0)

    def run(self) -> None:
        only = set(self.args.only.split(","))
        print(f"CPU: {cpu_class()}")
        print(f"load average at start: {load_average()}")
        print(f"data folder: {self.data}")
        self.open_window()
        self.wait_for_model()
        # One short reply first: the first pass of each kernel shape is not what a person
        # sees in steady use (and Python's first imports on the GUI thread are not either).
        self.send("Hi", 4)
        self.idle_all()
        # The engine's one-off background timing of this CPU's kernels (app/engine/
        # kernel_policy.py; a re-check when the choice is cached) runs after a second of
        # idleness, wherever a scenario happens to be by then, using every core: it is
        # waited for here, so a-c measure their own work. d (a relaunch) keeps its re-check.
        started = time.perf_counter()
        settled = self.controller.bridge.session.wait_for_policy(300)
        print(f"kernel policy measurement {'settled' if settled else 'still running'} "
              f"{time.perf_counter() - started:.1f} s after the warm-up reply")
        if "a" in only:
            self.measure("a: one chat streams", self.scenario_a)
        if "b" in only:
            self.measure("b: two streams + 3k-token document", self.scenario_b)
        long_chat = self.seed_long_chat(200, 1, "A long chat")  # ~4,000 tokens
        if "c" in only:
            big = self.seed_long_chat(200, 70, "A 200-message chat")
            self.controller.new_chat()
            idle(0.3)
            self.measure("c: open a 200-message chat", lambda beat: self.scenario_c(beat, big))
        if "d" in only:
            store = self.controller.store
            store.add_message(long_chat, "user", "One more question.")  # the newest chat
            store.add_message(long_chat, "assistant", seed_text(3, 1))
            self.close_window()
            shown = self.open_window()  # the heartbeat cannot tick while this runs
            self.measure("d: relaunch into a long chat",
                         lambda beat: self.scenario_d(beat, shown, long_chat))
        self.close_window()
        self.report()

    @staticmethod
    def print_result(name: str, s: dict, long: list) -> None:
        print(f"{name:40} {s['beats']:6d} {s['p50']:6.1f} {s['p99']:6.1f} {s['max']:6.1f} "
              f"{s['over50']:6d}")
        extra = {k: v for k, v in s.items() if k not in ("beats", "p50", "p99", "max", "over50")}
        if extra:
            print("    " + ", ".join(f"{k} {v:,.0f}" for k, v in extra.items()))
        for gap, phase in reversed(long):
            print(f"    gap {gap:6.1f} ms during {phase}")
        sys.stdout.flush()

    def report(self) -> None:
        print(f"load average at end: {load_average()}")
        print(f"sys.getswitchinterval() = {sys.getswitchinterval() * 1000:.1f} ms")
        print(f"\n{'scenario':40} {'beats':>6} {'p50':>6} {'p99':>6} {'max':>6} {'>50ms':>6}")
        for result in self.results:
            self.print_result(*result)
        for title, text in self.alerts:
            print(f"alert: {title}: {text}")
        for name, text in self.profiles.items():
            print(f"\n===== profile: {name} =====\n{text}")


def seed_text(i: int, words: int) -> str:
    """Message `i` of a seeded chat: prose, now and then a list or a code block."""
    body = " ".join(f"word{(i * 7 + k) % 97}" for k in range(words))
    if i % 2 == 0:
        return f"Question {i}: {body}?"
    if i % 6 == 1:
        return f"Answer {i}.\n\n{body}\n\n```python\nprint({i})\nx = {i} * 2\n```\n\nDone."
    if i % 6 == 3:
        return f"Answer {i}:\n\n- {body}\n- second point\n- third point\n\n**Bold** end."
    return f"Answer {i}. {body}.\n\nA second paragraph with *emphasis* and `code`."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="a,b,c,d", help="scenarios to run, e.g. a,c")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the GUI thread and time its events per scenario")
    parser.add_argument("--probe", action="store_true",
                        help="only the GIL probe of --profile (where every thread was when a "
                             "1 ms sleeper thread woke late), without cProfile")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for the run (Python's default is 5 ms)")
    args = parser.parse_args()
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    CACHE.mkdir(parents=True, exist_ok=True)
    app = EventTimer(sys.argv[:1]) if args.profile else QtWidgets.QApplication(sys.argv[:1])
    bench = Bench(args)
    try:
        bench.run()
    finally:
        shutil.rmtree(bench.data, ignore_errors=True)
    del app


if __name__ == "__main__":
    main()
