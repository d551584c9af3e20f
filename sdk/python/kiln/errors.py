"""Kiln's error envelope as a Python exception."""


class KilnError(Exception):
    """A refusal from the server (its error envelope), or a stream that ended in an error.

    ``code`` is Kiln's machine code (``not_found``, ``unauthorized``, ``build_error``…), ``status`` the HTTP
    status (0 when the error came inside a stream), ``request_id`` the id to quote in a bug report.
    """

    def __init__(self, message, code="error", status=0, request_id=None, detail=None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.request_id = request_id
        self.detail = detail or {}

    def __str__(self):
        where = " (%s, HTTP %s, %s)" % (self.code, self.status, self.request_id) if self.status else " (%s)" % self.code
        return self.message + where
