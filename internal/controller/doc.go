// Package controller holds the operator's reconcilers, one package per kind, and the RBAC the
// operator needs for them. The markers below are what controller-gen turns into
// config/rbac/operator/role.yaml; each reconciler adds its own beside its code.
//
// +kubebuilder:rbac:groups=imp.dev,resources=impvms;impnetworks,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/status;impnetworks/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/finalizers;impnetworks/finalizers,verbs=update
// +kubebuilder:rbac:groups=imp.dev,resources=impvmclasses,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch
// +kubebuilder:rbac:groups=coordination.k8s.io,resources=leases,verbs=get;list;watch;create;update;patch;delete
package controller
