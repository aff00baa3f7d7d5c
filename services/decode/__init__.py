"""Decode worker: continues prefilled requests (or prefills short ones) and streams tokens."""
