// Package controller holds the operator's reconcilers, one package per kind. Each declares the
// RBAC it needs beside its code; controller-gen gathers them into
// config/rbac/operator/role.yaml. The markers here are the manager's own: leader election.
//
// +kubebuilder:rbac:groups=coordination.k8s.io,resources=leases,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch
package controller
