// @kiln/sdk: a typed client for Kiln (docs/sdk.md).

export { createKiln } from "./client.ts";
export type { Kiln, KilnOptions, WebSocketLike } from "./client.ts";
export type { paths, components } from "./openapi.ts";
export { KilnApiError } from "./errors.ts";
export type { ErrorEnvelope } from "./errors.ts";
export { MachineSocket } from "./machine-socket.ts";
export type { ExecHandle, ExecOptions, ExecResult, PtyOptions, PtySession } from "./machine-socket.ts";
export { VolumeWatcher } from "./volume-watch.ts";
export type { VolumeWatch } from "./volume-watch.ts";
export type { BuildLogEntry } from "./builds.ts";
export type { FileEvent, ResyncRequired, ServerFrame } from "./frames.ts";
export { verifyWebhook, WebhookVerificationError } from "./webhooks.ts";
export type { WebhookEvent } from "./webhooks.ts";
