// Where tests keep what they share across files and runs (the base template is made once here), and which
// runtime this run's machines use.

export const TEST_CACHE_DIR = process.env.KILN_TEST_CACHE_DIR || "/var/tmp/kiln-test-cache";

/** The OCI runtime machines run on in this test run: `npm test` runs the machine suites once per runtime. */
export const TEST_RUNTIME: "runc" | "runsc" = process.env.KILN_OCI_RUNTIME === "runsc" ? "runsc" : "runc";
