// `npm run build:console`: bundles the web console into dist/console (served by `kiln serve` at /console).

import { buildConsole, CONSOLE_DIST_DIR } from "../src/console/bundle.ts";

const started = Date.now();
const { script, style } = await buildConsole();
process.stderr.write(`console built into ${CONSOLE_DIST_DIR} (${script}, ${style}) in ${Date.now() - started} ms\n`);
