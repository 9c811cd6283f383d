"""Result files (schema, the cell key, reading and writing) and the SQLite history index."""
