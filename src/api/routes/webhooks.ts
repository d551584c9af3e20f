// Lifecycle webhooks (SPEC.md's webhook endpoint table, under the Machines tag whose lifecycle they report):
// registrations, their deliveries with every attempt, the retry of a dead letter and the replay of any delivery.

import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { DELIVERY_STATUSES, WEBHOOK_OPERATIONS } from "../../webhooks/service.ts";
import { errors, Cursor, Id, Limit } from "../schemas.ts";
import { nextCursor, pageAfter } from "../../store/cursor.ts";

const tags = ["Machines"];
const Url = Type.String({ minLength: 1, maxLength: 2048, description: "Receiver URL, http or https, without credentials" });
const Operations = Type.Array(Type.Enum(WEBHOOK_OPERATIONS), { minItems: 1, maxItems: 16, uniqueItems: true });
const SigningSecret = Type.String({
  minLength: 1,
  maxLength: 512,
  writeOnly: true,
  description: "`whsec_` + base64 (16–128 bytes), or any string of 16+ characters used as its UTF-8 bytes. Write-only.",
});

const AllowPrivate = Type.Boolean({
  description:
    "Let this webhook reach private and loopback receivers (never link-local or metadata addresses) without KILN_WEBHOOK_ALLOW_PRIVATE. Setting it true takes the operator's key (403 otherwise); deliveries refused for the address go again at once",
});

const Webhook = Type.Object({
  id: Type.String(),
  url: Type.String(),
  operations: Type.Array(Type.Enum(WEBHOOK_OPERATIONS)),
  enabled: Type.Boolean(),
  allow_private: Type.Boolean(),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
});

const Attempt = Type.Object({
  attempt: Type.Integer(),
  started_at: Type.String({ format: "date-time" }),
  duration_ms: Type.Integer(),
  status_code: Type.Union([Type.Integer(), Type.Null()]),
  error: Type.Union([Type.String(), Type.Null()]),
  response_excerpt: Type.Union([Type.String(), Type.Null()]),
});

const Delivery = Type.Object({
  id: Type.String(),
  webhook_id: Type.String(),
  event_id: Type.String(),
  operation: Type.String(),
  status: Type.Enum(DELIVERY_STATUSES),
  attempts: Type.Array(Attempt),
  next_attempt_at: Type.Union([Type.String({ format: "date-time" }), Type.Null()]),
  last_status_code: Type.Union([Type.Integer(), Type.Null()]),
  last_error: Type.Union([Type.String(), Type.Null()]),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
  completed_at: Type.Union([Type.String({ format: "date-time" }), Type.Null()]),
});

const HookParams = Type.Object({ webhook_id: Id });
const DeliveryParams = Type.Object({ webhook_id: Id, delivery_id: Id });

export async function webhookRoutes(app: App, opts: { services: Services }) {
  const { webhooks, keys } = opts.services;

  app.post(
    "/v1/lifecycle/webhooks",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Register a lifecycle webhook; a generated signing_secret is in this response only",
        body: Type.Object({ url: Url, operations: Operations, signing_secret: Type.Optional(SigningSecret), allow_private: Type.Optional(AllowPrivate) }, { additionalProperties: false }),
        response: { 201: Type.Intersect([Webhook, Type.Object({ signing_secret: Type.Optional(Type.String()) })]), ...errors(400, 403) },
      },
    },
    async (req, reply) => reply.code(201).send(await webhooks.create(req.body, { operator: await keys.isOperator(req.apiKeyId) })),
  );

  app.get(
    "/v1/lifecycle/webhooks",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List webhooks, newest first",
        querystring: Type.Object({ limit: Type.Optional(Limit), cursor: Type.Optional(Cursor) }, { additionalProperties: false }),
        response: { 200: Type.Object({ webhooks: Type.Array(Webhook), next_cursor: Type.Union([Type.String(), Type.Null()]) }), ...errors(400) },
      },
    },
    async (req) => {
      const page = await webhooks.list({ limit: req.query.limit ?? 50, after: pageAfter(req.query.cursor) });
      return { webhooks: page.items, next_cursor: nextCursor(page) };
    },
  );

  app.get(
    "/v1/lifecycle/webhooks/:webhook_id",
    { config: { auth: "key" }, schema: { tags, summary: "Get a webhook", params: HookParams, response: { 200: Webhook, ...errors(404) } } },
    async (req) => webhooks.get(req.params.webhook_id),
  );

  app.patch(
    "/v1/lifecycle/webhooks/:webhook_id",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Update a webhook; a new signing_secret rotates it (the old one keeps signing beside it for 24 h)",
        params: HookParams,
        body: Type.Object(
          {
            url: Type.Optional(Url),
            operations: Type.Optional(Operations),
            signing_secret: Type.Optional(SigningSecret),
            enabled: Type.Optional(Type.Boolean()),
            allow_private: Type.Optional(AllowPrivate),
          },
          { additionalProperties: false, minProperties: 1 },
        ),
        response: { 200: Webhook, ...errors(400, 403, 404) },
      },
    },
    async (req) => webhooks.update(req.params.webhook_id, req.body, { operator: await keys.isOperator(req.apiKeyId) }),
  );

  app.delete(
    "/v1/lifecycle/webhooks/:webhook_id",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Delete a webhook; its pending deliveries are never sent",
        params: HookParams,
        response: { 200: Type.Object({ id: Type.String(), deleted: Type.Boolean() }), ...errors(404) },
      },
    },
    async (req) => webhooks.remove(req.params.webhook_id),
  );

  app.get(
    "/v1/lifecycle/webhooks/:webhook_id/deliveries",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List a webhook's deliveries, newest first, with their attempts",
        params: HookParams,
        querystring: Type.Object(
          { limit: Type.Optional(Limit), cursor: Type.Optional(Cursor), status: Type.Optional(Type.Enum(DELIVERY_STATUSES)) },
          { additionalProperties: false },
        ),
        response: { 200: Type.Object({ deliveries: Type.Array(Delivery), next_cursor: Type.Union([Type.String(), Type.Null()]) }), ...errors(400, 404) },
      },
    },
    async (req) => {
      const page = await webhooks.listDeliveries(req.params.webhook_id, { limit: req.query.limit ?? 50, after: pageAfter(req.query.cursor), status: req.query.status });
      return { deliveries: page.items, next_cursor: nextCursor(page) };
    },
  );

  app.get(
    "/v1/lifecycle/webhooks/:webhook_id/deliveries/:delivery_id",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Get a delivery: its status, every attempt, and the payload as sent",
        params: DeliveryParams,
        response: { 200: Type.Intersect([Delivery, Type.Object({ payload: Type.Unknown() })]), ...errors(404) },
      },
    },
    async (req) => webhooks.getDelivery(req.params.webhook_id, req.params.delivery_id),
  );

  app.post(
    "/v1/lifecycle/webhooks/:webhook_id/deliveries/:delivery_id/retry",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Queue a dead_letter delivery again for another run of the retry schedule",
        params: DeliveryParams,
        response: { 200: Delivery, ...errors(404, 409) },
      },
    },
    async (req) => webhooks.retryDelivery(req.params.webhook_id, req.params.delivery_id),
  );

  app.post(
    "/v1/lifecycle/webhooks/:webhook_id/deliveries/:delivery_id/replay",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Send a delivery's event again as a new delivery (any status, also a succeeded one): same event id and payload, a new delivery id",
        params: DeliveryParams,
        response: { 202: Delivery, ...errors(404, 409, 429) },
      },
    },
    async (req, reply) => reply.code(202).send(await webhooks.replayDelivery(req.params.webhook_id, req.params.delivery_id)),
  );
}
