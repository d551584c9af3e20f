// Source phase: the base the layers stack on (an OCI image is imported here, a snapshot's files copied out; other
// sources were resolved by prepare) and the digest of the whole build's input, recorded on the build.

import { sourceDigest } from "../cache/keys.ts";
import type { BuilderPhase } from "./phase.ts";
import { snapshotSource } from "../sources/snapshot.ts";

export const sourcePhase: BuilderPhase = {
  name: "source",
  applies: () => true,
  async run(run, env) {
    const { p } = run;
    let source = p.source;
    if (!source) {
      run.emit({ kind: "message", phase: "preparing", message: `importing ${p.request.base_image}` });
      const imported = await env.extensions!.ociImport!(p.request.base_image!, { auth: p.request.base_image_auth, signal: run.signal, dataDir: env.dataDir, log: (e) => run.emit(e), count: (c) => run.count(c) });
      source = { ...imported, type: "oci_import", description: p.request.base_image! };
    }
    if (p.fromSnapshot) {
      source = await snapshotSource(source!, p.fromSnapshot, { snapshots: env.snapshots!, layerCache: env.layerCache, layersDir: env.layersDir, emit: (e) => run.emit(e), count: (c) => run.count(c) });
    }
    run.source = source;
    const req = p.request;
    run.srcDigest = sourceDigest({ sourceDigest: source.digest, dockerfile: [p.dockerfile, ...p.keyInputs].join("\n"), contextDigest: p.contextDigest, startCmd: req.start_cmd, readyCmd: req.ready_cmd, runtimeDefaults: req.runtime_defaults });
    await env.db.updateTable("builds").set({ source_digest: run.srcDigest }).where("id", "=", p.buildId).execute();
  },
};
