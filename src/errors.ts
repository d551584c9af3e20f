// Kiln's error catalogue: every error code with its HTTP status and default message, in one place.
// Anything thrown anywhere becomes the SPEC.md envelope in toEnvelope(); routes never build envelopes by hand.

export const ERROR_CATALOGUE = {
  invalid_request: { status: 400, message: "The request is not valid" },
  unauthorized: { status: 401, message: "A valid API key is required: Authorization: Bearer <key>" },
  forbidden: { status: 403, message: "This action is not allowed" },
  not_found: { status: 404, message: "Not found" },
  method_not_allowed: { status: 405, message: "Method not allowed" },
  conflict: { status: 409, message: "The resource is in a conflicting state" },
  machine_not_running: { status: 409, message: "The machine is not running" },
  payload_too_large: { status: 413, message: "The request body is too large" },
  unsupported_media_type: { status: 415, message: "Unsupported content type" },
  git_error: { status: 422, message: "The git operation failed" },
  build_rejected: { status: 422, message: "The build was rejected" },
  build_error: { status: 422, message: "The build failed" },
  rate_limited: { status: 429, message: "Too many requests" },
  internal: { status: 500, message: "Internal error" },
  unavailable: { status: 503, message: "The service is unavailable" },
  timeout: { status: 504, message: "The operation timed out" },
} as const;

export type ErrorCode = keyof typeof ERROR_CATALOGUE;

export interface ErrorDetail {
  code?: string;
  message?: string;
  phase?: string;
  retryable?: boolean;
  suggested_action?: string;
  step_index?: number;
  attempt?: number;
  max_attempts?: number;
  cache_subject?: string;
  build_id?: string;
  request_id?: string;
  details?: Record<string, unknown>;
}

export class KilnError extends Error {
  readonly code: ErrorCode;
  readonly status: number;
  readonly detail: ErrorDetail | undefined;
  readonly buildId: string | undefined;

  constructor(code: ErrorCode, message?: string, opts: { detail?: ErrorDetail; buildId?: string; cause?: unknown } = {}) {
    super(message ?? ERROR_CATALOGUE[code].message, { cause: opts.cause });
    this.name = "KilnError";
    this.code = code;
    this.status = ERROR_CATALOGUE[code].status;
    this.detail = opts.detail;
    this.buildId = opts.buildId;
  }
}

export interface ErrorEnvelope {
  error: string;
  code: string;
  request_id: string;
  error_detail?: ErrorDetail;
  build_id?: string;
}

/** Maps Fastify's own error codes (raised before or around a handler) onto the catalogue. */
const FASTIFY_CODES: Record<string, ErrorCode> = {
  FST_ERR_CTP_INVALID_JSON_BODY: "invalid_request",
  FST_ERR_CTP_EMPTY_JSON_BODY: "invalid_request",
  FST_ERR_CTP_BODY_TOO_LARGE: "payload_too_large",
  FST_ERR_CTP_INVALID_MEDIA_TYPE: "unsupported_media_type",
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: "invalid_request",
  FST_ERR_VALIDATION: "invalid_request",
  FST_ERR_NOT_FOUND: "not_found",
};

/** Turns anything thrown into the status and envelope the client sees. A 500 carries no stack and no cause text. */
export function toEnvelope(err: unknown, requestId: string): { status: number; body: ErrorEnvelope } {
  if (err instanceof KilnError) {
    const body: ErrorEnvelope = { error: err.message, code: err.code, request_id: requestId };
    if (err.detail) body.error_detail = { ...err.detail, request_id: requestId };
    if (err.buildId) body.build_id = err.buildId;
    return { status: err.status, body };
  }
  const e = err as { code?: string; statusCode?: number; message?: string; validation?: unknown; validationContext?: string };
  const mapped = e?.code ? FASTIFY_CODES[e.code] : undefined;
  if (mapped) {
    let message = e.message ?? ERROR_CATALOGUE[mapped].message;
    if (mapped === "invalid_request" && e.code === "FST_ERR_CTP_INVALID_JSON_BODY") message = "The request body is not valid JSON";
    const body: ErrorEnvelope = { error: message, code: mapped, request_id: requestId };
    if (e.validation) body.error_detail = { code: "invalid_request", message, details: { [e.validationContext ?? "body"]: e.validation } };
    return { status: ERROR_CATALOGUE[mapped].status, body };
  }
  // Fastify client errors we did not name (4xx) keep their status but speak the catalogue's words.
  if (e?.statusCode && e.statusCode >= 400 && e.statusCode < 500) {
    const code = codeForStatus(e.statusCode);
    return { status: ERROR_CATALOGUE[code].status, body: { error: e.message ?? ERROR_CATALOGUE[code].message, code, request_id: requestId } };
  }
  return { status: 500, body: { error: ERROR_CATALOGUE.internal.message, code: "internal", request_id: requestId } };
}

function codeForStatus(status: number): ErrorCode {
  for (const [code, entry] of Object.entries(ERROR_CATALOGUE)) if (entry.status === status) return code as ErrorCode;
  return "invalid_request";
}
