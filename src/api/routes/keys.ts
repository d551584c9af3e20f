// API Keys: create (the key is shown once), list (prefixes only), revoke.

import { KilnError } from "../../errors.ts";
import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { KEY_FORMATS, generateKeyIn } from "../../keys/service.ts";
import { errors, Id } from "../schemas.ts";

const KeySummary = Type.Object({
  id: Type.String(),
  name: Type.String(),
  prefix: Type.String(),
  created_at: Type.String(),
  last_used_at: Type.Union([Type.String(), Type.Null()]),
  revoked_at: Type.Union([Type.String(), Type.Null()]),
});

export async function keyRoutes(app: App, opts: { services: Services }) {
  const { keys } = opts.services;

  app.post(
    "/v1/keys",
    {
      config: { auth: "key" },
      schema: {
        tags: ["API Keys"],
        summary: "Create an API key; the key is in this response only",
        body: Type.Object(
          { name: Type.String({ minLength: 1, maxLength: 100 }), format: Type.Optional(Type.Union(KEY_FORMATS.map((f) => Type.Literal(f)), { description: "kiln (default) or e2b: e2b_<hex>, the shape the E2B SDK accepts" })) },
          { additionalProperties: false },
        ),
        response: { 201: Type.Intersect([KeySummary, Type.Object({ key: Type.String() })]), ...errors(400) },
      },
    },
    async (req, reply) => reply.code(201).send(await keys.create(req.body.name, generateKeyIn(req.body.format ?? "kiln"))),
  );

  app.get(
    "/v1/keys",
    { config: { auth: "key" }, schema: { tags: ["API Keys"], summary: "List API keys", response: { 200: Type.Object({ keys: Type.Array(KeySummary) }), ...errors() } } },
    async () => ({ keys: await keys.list() }),
  );

  app.delete(
    "/v1/keys/:id",
    {
      config: { auth: "key" },
      schema: {
        tags: ["API Keys"],
        summary: "Revoke an API key",
        params: Type.Object({ id: Id }),
        response: { 200: KeySummary, ...errors(403, 404, 409) },
      },
    },
    async (req) => {
      // The operator's keys hold what others may not (drain, allow_private): only the operator revokes them, else any
      // key could take those from the operator (and a revoked KILN_API_KEY is never seeded again).
      if ((await keys.isOperator(req.params.id)) && !(await keys.isOperator(req.apiKeyId))) {
        throw new KilnError("forbidden", "Revoking the operator's key (KILN_API_KEY or the first-start key) takes the operator's key");
      }
      return keys.revoke(req.params.id);
    },
  );
}
