// Validates rendered Kubernetes manifests (kubectl kustomize output) against
// the API schemas shipped in the npm package kubernetes-models: types,
// required fields, enums, formats. It does not catch misspelled field names
// (the schemas allow unknown properties); check_fields.py covers the fields
// that matter.
//   node tests/deploy/validate_k8s.mjs rendered.yaml [more.yaml ...]
// Exit code 0 only when every document is a known kind and validates.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { parseAllDocuments } from "yaml";

const require = createRequire(import.meta.url);

// "batch/v1" + "Job" -> "kubernetes-models/batch/v1/Job"; core is "v1".
function modelFor(apiVersion, kind) {
  if (!/^[a-z0-9.]+(\/[a-z0-9]+)?$/.test(apiVersion) || !/^[A-Za-z]+$/.test(kind)) {
    throw new Error(`unexpected apiVersion/kind ${apiVersion}/${kind}`);
  }
  const mod = require(`kubernetes-models/${apiVersion}/${kind}`);
  const model = mod[kind] ?? mod.default?.[kind];
  if (typeof model !== "function") {
    throw new Error(`kubernetes-models has no ${apiVersion} ${kind}`);
  }
  return model;
}

let failures = 0;
let checked = 0;
const files = process.argv.slice(2);
if (files.length === 0) {
  console.error("usage: node validate_k8s.mjs FILE.yaml...");
  process.exit(2);
}
for (const file of files) {
  const docs = parseAllDocuments(readFileSync(file, "utf8"));
  for (const doc of docs) {
    if (doc.errors.length > 0) {
      console.error(`${file}: YAML error: ${doc.errors[0].message}`);
      failures++;
      continue;
    }
    const obj = doc.toJS();
    if (obj === null || obj === undefined) continue;
    const name = `${file}: ${obj.apiVersion} ${obj.kind} ${obj.metadata?.name}`;
    try {
      const Model = modelFor(obj.apiVersion, obj.kind);
      new Model(obj).validate();
      checked++;
      console.log(`ok   ${name}`);
    } catch (err) {
      failures++;
      console.error(`FAIL ${name}: ${err.message}`);
    }
  }
}
console.log(`kubernetes-models: ${checked} documents valid, ${failures} failed`);
process.exit(failures === 0 && checked > 0 ? 0 : 1);
