"""Storage: chats (message trees with versions), added models and app settings in one SQLite
file in the data directory. Pure Python and sqlite3 -- no Qt, no torch -- so the GUI and the
CLI share it.

    store = ChatStore()                  # data_dir()/ferrox.sqlite3, created or upgraded
    store.mark_interrupted()             # once at start-up
    chat = store.create_chat()
    store.add_message(chat.id, "user", "Hello")
    reply = store.add_message(chat.id, "assistant", "", status="streaming")
    store.update_message(reply.id, content="Hi!", status="complete")

Every failure is a `StorageError` whose message can be shown as it is.
"""

from app.storage.chats import DEFAULT_TITLE, ChatStore
from app.storage.database import DB_FILENAME, database_path, set_aside, set_aside_name
from app.storage.errors import StorageError, UnreadableDatabase
from app.storage.export import export_file_name, export_json, export_markdown
from app.storage.importing import (ChatImportError, ImportLimits, import_chat_file, import_json,
                                   read_chat_export)
from app.storage.messages import HEAD
from app.storage.records import (ROLES, STATUSES, Attachment, Chat, Message, ModelRecord,
                                 NewAttachment, Versions)

__all__ = [
    "DB_FILENAME", "DEFAULT_TITLE", "HEAD", "ROLES", "STATUSES", "Attachment", "Chat", "ChatStore",
    "Message", "ModelRecord", "NewAttachment", "StorageError", "Versions", "database_path",
    "export_file_name", "export_json", "export_markdown", "import_json", "ChatImportError",
    "ImportLimits", "import_chat_file", "read_chat_export", "set_aside", "set_aside_name",
    "UnreadableDatabase",
]
