"""The one error type a dropped document can raise.

Every way a file can fail to become prompt text -- missing, unreadable, a folder, empty, too
large, binary, a model file, a scanned or encrypted or damaged PDF, a damaged Word file, an
unknown text encoding -- ends in a `DocumentError` whose message names the file and says why in
plain words. The UI shows `str(error)` as it is.
"""


class DocumentError(Exception):
    """A file cannot be attached to a prompt. `str(error)` names the file and gives the reason."""

    def __init__(self, name: str, reason: str):
        super().__init__(f'Cannot attach "{name}": {reason}')
        self.name = name
        self.reason = reason

    def __reduce__(self):
        # Errors cross threads (and maybe processes) as data; keep them picklable.
        return type(self), (self.name, self.reason)
