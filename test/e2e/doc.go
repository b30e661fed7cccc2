// Package e2e holds end-to-end suites: real binaries (kubectl, and later the operator, the
// agent, helm and QEMU) against a real control plane.
package e2e
