"""Run by test_resilience in a subprocess: start the app, send one long message, keep
streaming until the parent kills the process. Prints "saved <monotonic s> <chars>" after each
save of the streaming reply."""

from __future__ import annotations

import sys
import time

from app.main import create_main_window
from app.ui.qt import QTimer, QtWidgets


def main(data_dir: str, model: str) -> None:
    window = create_main_window(["--data-dir", data_dir, "--model", model])
    controller = window.controller
    controller._alert = lambda title, text: print(f"alert: {title}: {text}", flush=True)
    store_update = controller.store.update_message

    def logged_update(message_id, **changes):
        """The real save, logged: the parent measures the gaps between streaming saves."""
        result = store_update(message_id, **changes)
        if "content" in changes and "status" not in changes:
            print(f"saved {time.monotonic():.4f} {len(changes['content'])}", flush=True)
        return result

    controller.store.update_message = logged_update
    app = QtWidgets.QApplication.instance()

    def send_when_ready() -> None:
        if controller.model_info is None:
            return
        timer.stop()
        # Greedy: the reply must still be streaming when the test kills this process (a
        # sampled one, temperature 1.0, had now and then ended before 400 characters).
        controller.store.update_chat_settings(controller.current_chat_id,
                                              {"max_tokens": 2000, "temperature": 0})
        window.composer.set_text("Tell me a very long story about a lighthouse.")
        window.composer.findChild(QtWidgets.QPushButton, "sendButton").click()
        print("sent", flush=True)

    timer = QTimer()
    timer.timeout.connect(send_when_ready)
    timer.start(50)
    window.show()
    app.exec()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
