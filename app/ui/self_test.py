"""`--self-test`: one message through the real GUI path, the reply printed, exit 0 (or not).

Packaged builds run it to prove that the frozen app loads its model, generates and saves.
"""

from __future__ import annotations

import sys
import time

from app.ui.qt import QTimer

PROMPT = "Hello! Write one short sentence about the sea."
TIMEOUT_S = 300


def run_self_test(window, app) -> int:
    controller = window.controller
    # No modal dialogs in a self-test: problems go to stderr and end the test.
    controller._alert = lambda title, text: print(f"self-test: {title}: {text}", file=sys.stderr)
    controller._confirm = lambda title, text: True
    state = {"sent": False, "started": time.monotonic(), "code": None}

    def finish(code: int, message: str) -> None:
        if state["code"] is None:
            state["code"] = code
            print(message, file=sys.stdout if code == 0 else sys.stderr, flush=True)
            window.close()
            app.exit(code)

    def poll() -> None:
        if time.monotonic() - state["started"] > TIMEOUT_S:
            return finish(1, "self-test: timed out")
        if controller.model_error:
            return finish(1, f"self-test: the model failed to load: {controller.model_error}")
        if controller.model_info is None:
            return
        if not state["sent"]:
            controller.new_chat()
            controller.store.update_chat_settings(controller.current_chat_id, {"max_tokens": 48})
            window.composer.set_text(PROMPT)
            window.composer.findChild(type(window.new_chat_button), "sendButton").click()
            state["sent"] = True
            return
        if controller.replies:
            return
        path = controller.store.active_path(controller.current_chat_id)
        if len(path) < 2 or path[-1].role != "assistant":
            return finish(1, "self-test: the message was not sent")
        reply = path[-1]
        if reply.status != "complete":
            return finish(1, f"self-test: the reply ended as {reply.status}: {reply.error or ''}")
        info = controller.model_info
        decode = f", decode steps in {info.decode_step}" if info.decode_step else ""
        finish(0, f"self-test reply ({info.name}, {info.device}, {info.dtype}{decode}): "
                  f"{reply.content.strip()!r}")

    timer = QTimer(window)
    timer.timeout.connect(poll)
    timer.start(100)
    window.show()
    app.exec()
    return state["code"] if state["code"] is not None else 1
