"""Turning a stored document into chunks and vectors: page-by-page extraction (`extract`),
deterministic streaming chunking (`chunking`) and pluggable embedding (`embed`). Pure and
streaming: nothing here touches the database or holds a whole document in memory."""
