// Kiln's error envelope as an Error: every failed call of the SDK's helpers throws this, with the server's code.

export interface ErrorEnvelope {
  error: string;
  code: string;
  request_id?: string;
  error_detail?: Record<string, unknown>;
  build_id?: string;
}

export class KilnApiError extends Error {
  readonly status: number;
  readonly code: string;
  readonly requestId: string | undefined;
  readonly envelope: ErrorEnvelope | undefined;

  constructor(status: number, envelope: ErrorEnvelope | undefined, fallback?: string) {
    super(envelope?.error ?? fallback ?? `Kiln answered HTTP ${status}`);
    this.name = "KilnApiError";
    this.status = status;
    this.code = envelope?.code ?? (status >= 500 ? "internal" : "invalid_request");
    this.requestId = envelope?.request_id;
    this.envelope = envelope;
  }
}

/** Turns a failed Response into a KilnApiError (its body read as the envelope when it is one). */
export async function errorFromResponse(res: Response): Promise<KilnApiError> {
  const text = await res.text().catch(() => "");
  try {
    const body = JSON.parse(text) as ErrorEnvelope;
    if (typeof body?.code === "string") return new KilnApiError(res.status, body);
  } catch {
    // not an envelope
  }
  return new KilnApiError(res.status, undefined, text.slice(0, 500) || undefined);
}
