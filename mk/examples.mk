# examples/ts-ledger: a JetRL env in TypeScript (docs/env-protocol.md). npm installs its packages into its own
# node_modules (ignored by git) from package-lock.json, and tsc builds dist/; tests/envs/test_ts_env.py runs this
# target first and skips, saying why, where node or npm is missing.
TS_LEDGER := examples/ts-ledger

.PHONY: setup-ts-ledger
setup-ts-ledger: $(TS_LEDGER)/dist/main.js

$(TS_LEDGER)/node_modules/.package-lock.json: $(TS_LEDGER)/package.json $(TS_LEDGER)/package-lock.json
	cd $(TS_LEDGER) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(TS_LEDGER)/dist/main.js: $(TS_LEDGER)/node_modules/.package-lock.json $(TS_LEDGER)/tsconfig.json $(wildcard $(TS_LEDGER)/src/*.ts)
	cd $(TS_LEDGER) && npx --no-install tsc -p .
	touch $@

# examples/readers: outside readers of a run's streams (Python and Node, as the observer). npm installs the
# Node one's two packages from package-lock.json; tests/cli/test_readers.py runs this target and skips without node.
READERS := examples/readers

.PHONY: setup-readers
setup-readers: $(READERS)/node_modules/.package-lock.json

$(READERS)/node_modules/.package-lock.json: $(READERS)/package.json $(READERS)/package-lock.json
	cd $(READERS) && npm ci --no-audit --no-fund --loglevel=error
	touch $@
