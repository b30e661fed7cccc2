# IMP — the two commands that matter are at the top of README.md:
#   make dev    bring IMP up locally and run a VM
#   make test   run every test, installing what it needs first
SHELL := /usr/bin/env bash
CONTROLLER_GEN := go tool controller-gen
GENERATED := api config

.PHONY: all build test unit generate verify-generated vet setup dev dev-down bench-controlplane bench-warmpool bench-compare bench-disk bench-agent bench-tracing bench-access bench-net bench-netpol bench-suspend bench-overhead bench-services bench-snapshot bench-idle bench-wake bench-migrate bench-volumes bench-os images chart-push

all: build

build: ## Build the four binaries into bin/.
	go build -o bin/ ./cmd/...

test: ## Every test, on a fresh machine too (installs its prerequisites).
	hack/test.sh

unit: ## Unit tests only: no control plane, no root.
	go test ./api/... ./internal/...

generate: ## Regenerate deepcopy, CRDs and RBAC from the Go types and markers.
	$(CONTROLLER_GEN) object:headerFile=hack/boilerplate.go.txt paths=./api/...
	$(CONTROLLER_GEN) crd paths=./api/... output:crd:artifacts:config=config/crd/bases
	$(CONTROLLER_GEN) rbac:roleName=imp-operator paths="./internal/controller/...;./internal/pki/...;./internal/subresources/...;./internal/agentcsr/..." output:rbac:artifacts:config=config/rbac/operator
	$(CONTROLLER_GEN) rbac:roleName=imp-agent paths=./internal/agent/... output:rbac:artifacts:config=config/rbac/agent
	rm -f charts/imp/files/crds/*.yaml
	cp config/crd/bases/*.yaml charts/imp/files/crds/
	cp config/rbac/operator/role.yaml charts/imp/files/operator-role.yaml
	cp config/rbac/agent/role.yaml charts/imp/files/agent-role.yaml

verify-generated: ## Fail when the checked-in generated code differs from what the sources generate.
	hack/verify-generated.sh

vet:
	go vet ./...

setup: ## Build the local control plane binaries (cached outside the repo).
	hack/setup-control-plane.sh

dev: ## Bring IMP up locally and run a VM (hack/dev-down.sh tears it down).

	hack/dev.sh

dev-down: ## Tear down what make dev started.
	hack/dev-down.sh

N ?= 1000
M ?= 100
RUNS ?= 3
bench-controlplane: ## N VMs over M simulated nodes, RUNS runs: create→Scheduled/Running, VMs/s, requests/VM, memory.
	go build -o bin/ ./cmd/imp-operator
	go run ./test/bench/controlplane -n $(N) -m $(M) -runs $(RUNS)

bench-warmpool: ## An ImpWarmPool of 50 over 10 simulated nodes: claim → guest ready (one, ten at once) beside the API server's floor, claims/s, API writes per claim; then real guests (QEMU/TCG): claim → exec, one and ten at once, and the node's handover plan.
	go build -o bin/ ./cmd/imp-operator
	go run ./test/bench/controlplane -n 200 -m 10 -runs 1 -warm 50 | grep -E '^run|warm|bare:|^  (place|run): create'
	IMP_BENCH=warmclaims go test -count=1 -v -timeout 30m -run '^TestBenchWarmClaims$$' ./internal/agent/ | grep -E '^warm|^(ok|FAIL|---)'

bench-compare: ## The control-plane bench of BASE (a commit) and HEAD alternated, RUNS runs each (N VMs, M nodes): each figure's median on both and the ratio.
	go run ./test/bench/compare -base $(BASE) -runs $(RUNS) -- -n $(N) -m $(M)

bench-pool: ## An ImpVMPool scaled 0 → 50 on simulated nodes: scale → guest ready P50/P99 per VM and in all, against 50 plain ImpVMs created at once.
	go build -o bin/ ./cmd/imp-operator
	go run ./test/bench/controlplane -n 50 -m 5 -runs 3 -creators 50 -pool 50 | grep -E '^  (run: create|pool|run: throughput)|^[a-z].*(pool|run: create)'

bench-disk: ## Cold image → base disk MB/s; second VM disk preparation time.
	go run ./test/bench/disk -mb 64 -runs 3

bench-agent: ## Real guests: placement → VMM exec P50, create → ready P50, agent RSS with 0 and 16 VMs.
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o bin/ ./cmd/imp-agent # as hack/images.sh builds it
	go run ./test/bench/agent -n 10

bench-tracing: ## Real guests: what tracing every start costs the start path, off and on in the order off, on, on, off, ... (RUNS each).
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o bin/ ./cmd/imp-agent
	go run ./test/bench/agent -n 4 -tracing-runs $(or $(RUNS),2)

bench-access: ## A QEMU/TCG guest: `exec VM -- true` round trip P50 through the API server; port-forward MiB/s (IMP_BENCH_MIB, 100).
	IMP_BENCH=access go test -count=1 -v -timeout 30m -run '^TestBenchAccess$$' ./internal/agent/ | grep -E 'access_bench_test|^(ok|FAIL|---)'

bench-services: ## A QEMU/TCG guest behind a Service: VM Ready → endpoint ready P50/P99; requests/s through kube-proxy and its endpoint vs direct.
	IMP_BENCH=services go test -count=1 -v -timeout 30m -run '^TestBenchServices$$' ./internal/agent/ | grep -E '^(VM Ready|HTTP/1.0)|^(ok|FAIL|---)'

bench-net: ## Tap + bridge + rules setup per VM (P50/P99) with 100 VMs on one node; overlay sync (root).
	go run ./test/bench/net -n 100

bench-netpol: ## 1,000 NetworkPolicies, 1,000 pods' and VMs' addresses, 50 VMs on the node: the time to apply a change; a TCP stream to a VM (bridged, and routed to its endpoint) under policy against none (root).
	IMP_BENCH=netpol go test -count=1 -v -timeout 10m -run '^TestBenchNetpol$$' ./internal/agent/hostnet/ | grep -E '^netpol|^(ok|FAIL|---)'

bench-overhead: ## Memory a QEMU VMM holds beyond its guest's RAM, for guests of 128, 256 and 512 MiB.
	go run ./test/bench/overhead -sizes 128,256,512

bench-suspend: ## Suspend and resume a 256 MiB guest under QEMU (TCG here): P50 of each.
	go run ./test/bench/suspend -rounds 5 -memory 256

bench-snapshot: ## QEMU/TCG guests of 256 MiB: create → Ready P50/P99 cold vs restored from a snapshot (1 VM, 10 at once); snapshot pause and size.
	IMP_BENCH=snapshot go test -count=1 -v -timeout 60m -run '^TestBenchSnapshot$$' ./internal/agent/ | grep -E '^(create|snapshot|restore|start steps)|^(ok|FAIL|---)'

bench-wake: ## An idle-suspended VM (QEMU/TCG, 256 MiB): first request → first byte P50/P99, beside the running VM and its plain resume (the floor); the memory given back.
	IMP_BENCH=wake go test -count=1 -v -timeout 30m -run '^TestBenchWake$$' ./internal/agent/ | grep -E '^(wake|  )|^(ok|FAIL|---)'

bench-migrate: ## Running guests of 128 MiB, 256 MiB and 1 GiB (QEMU/TCG) moved between two nodes' agents: downtime, creation → Succeeded, MiB/s beside loopback and disk; then a busy 1 GiB guest dirtying 512 MiB at 1 GiB/s.
	IMP_BENCH=migrate go test -count=1 -v -timeout 30m -run '^TestBenchMigrate(Busy)?$$' ./internal/agent/ | grep -E '^(migrate|  )|^(ok|FAIL|---)'

bench-idle: ## A warm pool's idle member (QEMU/TCG, 256 MiB): VMM CPU and PSS running idle against paused; cont and the first exec after it.
	IMP_BENCH=idle go test -count=1 -v -timeout 30m -run '^TestBenchIdle$$' ./internal/agent/ | grep -E '^(idle|  )|^(ok|FAIL|---)'

bench-volumes: ## A QEMU/TCG guest's raw disk volume: sequential MB/s and 4 KiB random IOPS in the guest against the same file on the node, through the page cache and direct.
	IMP_BENCH=volumes go test -count=1 -v -timeout 30m -run '^TestBenchVolumes$$' ./internal/agent/ | grep -E '^volume |^(ok|FAIL|---)'

bench-os: ## create → Ready of the Debian VM of hack/os-image.sh (spec.boot OS), without and with cloud-init, beside the workload VM's: P50 of five, and where the OS's boot goes.
	IMP_BENCH=os go test -count=1 -v -timeout 60m -run '^TestBenchOS$$' ./internal/agent/ | grep -E '^(os |  )|^(ok|FAIL|---)'

images: ## Build imp-operator and imp-agent without Docker, push to REGISTRY (host:port), print digests.
	hack/images.sh $(REGISTRY)

chart-push: ## Package charts/imp and push it to oci://$(REGISTRY)/charts.
	hack/chart-push.sh $(REGISTRY)
