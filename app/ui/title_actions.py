"""Chat titles made by the model: after a chat's first reply, the loaded model is asked in
the background for a 3-6 word title, which replaces the quick one the chat got when it was
sent -- unless the person renamed it meanwhile. A mixin of `ChatController`."""

from __future__ import annotations

from app.engine.events import Failed, Finished, Token
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message as PromptMessage
from app.storage import StorageError
from app.ui import builtin_models
from app.ui.reasoning_view import split_reasoning
from app.ui.titles import TITLE_MAX_TOKENS, clean_title, title_request


class TitleActions:
    def _maybe_ask_for_title(self, chat_id: int) -> None:
        """After a chat's first reply, ask the model in the background for a short title,
        unless the person renamed the chat or the model cannot write one (see
        builtin_models.writes_titles)."""
        chat = self.store.get_chat(chat_id)
        path = self.store.active_path(chat_id)
        if (self.model_info is None or not builtin_models.writes_titles(self.model_info.path)
                or self._auto_titles.get(chat_id) != chat.title or len(path) != 2
                or any(chat_id == c for c, _ in self._title_jobs.values())):
            return
        question, answer = path
        _reasoning, answer_text = split_reasoning(answer.content)
        prompt = title_request(question.content, answer_text,
                               [a.name for a in question.attachments])
        request_id = f"title{chat_id}-{next(self._request_ids)}"
        self._title_jobs[request_id] = (chat_id, "")
        self.bridge.submit(request_id, [PromptMessage("user", prompt)],
                           SamplingParams(temperature=0.0, max_tokens=TITLE_MAX_TOKENS))

    def _on_title_event(self, event) -> None:
        chat_id, text = self._title_jobs[event.request_id]
        if isinstance(event, Token):
            self._title_jobs[event.request_id] = (chat_id, text + event.text)
        elif isinstance(event, (Finished, Failed)):
            del self._title_jobs[event.request_id]
            _reasoning, answer = split_reasoning(getattr(event, "text", text) or text)
            title = clean_title(answer) if isinstance(event, Finished) else None
            try:
                chat = self.store.get_chat(chat_id)
            except StorageError:
                return  # deleted for good meanwhile
            if title and self._auto_titles.get(chat_id) == chat.title:  # not renamed since
                self._auto_titles[chat_id] = title
                self.rename_chat(chat_id, title, automatic=True)
