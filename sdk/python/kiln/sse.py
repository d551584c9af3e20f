"""Server-Sent Events read from a binary response, one event at a time (the subset Kiln sends)."""


def read_events(response, max_line=1 << 20):
    """Yields ``(id, event, data)`` for each event; comments (``: keepalive``) are skipped."""
    event_id, event, data = None, "message", []
    while True:
        raw = response.readline(max_line + 1)
        if not raw:
            return
        if len(raw) > max_line:
            raise ValueError("an SSE line is longer than %d bytes" % max_line)
        line = raw.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data:
                yield event_id, event, "\n".join(data)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "id":
            event_id = value
        elif field == "event":
            event = value
        elif field == "data":
            data.append(value)
