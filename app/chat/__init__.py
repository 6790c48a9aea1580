"""The chat service: what a conversation is, apart from any window or model. No Qt.

  budget.py     the context budget: how many tokens a reply may take (GUI, API, backends)
  documents.py  a chat's documents: whole in the prompt or searched, passages kept per reply
  prompt.py     a conversation's path of stored messages -> the messages the model reads
  metadata.py   the saved metadata of a finished reply (one schema, written in one place)
  replies.py    a reply in progress: its state and text while it streams
  service.py    the reply lifecycle: start, stream, finish / fail / stop, saved as it goes

`budget.py` imports nothing, so layers below this one (backends, the engine) may use it too:
it is the one module of app/chat that is allowed to be imported from below.
"""
