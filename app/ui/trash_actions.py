"""The Trash half of the controller: deleted chats wait in the Trash until restored or
deleted for good (the 8-second Undo stays for the quick case). A mixin of `ChatController`."""

from __future__ import annotations

from app.ui.trash_dialog import TrashDialog


class TrashActions:
    def open_trash(self) -> TrashDialog:
        """Show the Trash (not blocking: it is window-modal, opened with open())."""
        if self.trash_dialog is None:
            dialog = self.trash_dialog = TrashDialog(self.window)
            dialog.restoreRequested.connect(self.restore_chats)
            dialog.purgeRequested.connect(self.purge_chats)
            dialog.emptyRequested.connect(self.empty_trash)
        self.trash_dialog.set_chats(self.store.list_deleted_chats())
        self.trash_dialog.open()
        return self.trash_dialog

    def restore_chats(self, chat_ids: list[int]) -> None:
        for chat_id in chat_ids:
            self.store.restore_chat(chat_id)
        if self._deleted_chat_id in chat_ids:
            self._forget_undo()
        self.current_chat_id = chat_ids[0]
        self.refresh_chat_list()
        self.show_chat(chat_ids[0])
        self._refresh_trash()

    def purge_chats(self, chat_ids: list[int]) -> None:
        count = len(chat_ids)
        if not self._confirm("Delete for good?", f"Delete {count} chat{'s' * (count != 1)} for "
                             "good? This cannot be undone."):
            return
        for chat_id in chat_ids:
            self.store.purge_chat(chat_id)
        self._after_purge(chat_ids)

    def empty_trash(self) -> None:
        chats = self.store.list_deleted_chats()
        if not chats or not self._confirm(
                "Empty the Trash?", f"Delete the {len(chats)} chat{'s' * (len(chats) != 1)} in "
                "the Trash for good? This cannot be undone."):
            return
        self.store.purge_deleted()
        self._after_purge([c.id for c in chats])

    def _after_purge(self, chat_ids: list[int]) -> None:
        if self._deleted_chat_id in chat_ids:
            self._forget_undo()
        for chat_id in chat_ids:
            self._last_usage.pop(chat_id, None)
            self.pending.pop(chat_id, None)
            self.bridge.forget_cache_owner(str(chat_id))  # its pages on disk go too
        self._refresh_trash()
        self._update_trash_button()

    def _refresh_trash(self) -> None:
        if self.trash_dialog is not None and self.trash_dialog.isVisible():
            self.trash_dialog.set_chats(self.store.list_deleted_chats())

    def _update_trash_button(self) -> None:
        count = len(self.store.list_deleted_chats())
        self.window.trash_button.setText(f"Trash ({count})" if count else "Trash")
