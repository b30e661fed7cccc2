package steps

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestinit/probe"
)

// Defaults of a probe's fields, a Pod's, for objects stored before the API defaulted them.
const (
	defaultPeriod, defaultTimeout, defaultFailures = 10, 1, 3
)

// probes resolves the VM's probes for imp-init: named ports become numbers (of spec.ports),
// defaults are applied, and a kill's grace period is the probe's or else the VM's.
func probes(vm *impv1.ImpVM) (probe.Set, error) {
	grace := int64(30)
	if g := vm.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = *g
	}
	var set probe.Set
	for _, p := range []struct {
		name string
		in   *impv1.Probe
		out  **probe.Spec
	}{{"startupProbe", vm.Spec.StartupProbe, &set.Startup}, {"readinessProbe", vm.Spec.ReadinessProbe, &set.Readiness}, {"livenessProbe", vm.Spec.LivenessProbe, &set.Liveness}} {
		if p.in == nil {
			continue
		}
		s, err := resolveProbe(vm, p.in, grace)
		if err != nil {
			return set, fmt.Errorf("%s: %w", p.name, err)
		}
		*p.out = s
	}
	return set, nil
}

func resolveProbe(vm *impv1.ImpVM, in *impv1.Probe, grace int64) (*probe.Spec, error) {
	s := &probe.Spec{
		InitialDelaySeconds: in.InitialDelaySeconds, TimeoutSeconds: orDefault(in.TimeoutSeconds, defaultTimeout),
		PeriodSeconds: orDefault(in.PeriodSeconds, defaultPeriod), SuccessThreshold: orDefault(in.SuccessThreshold, 1),
		FailureThreshold: orDefault(in.FailureThreshold, defaultFailures), GraceSeconds: grace,
	}
	if in.TerminationGracePeriodSeconds != nil {
		s.GraceSeconds = *in.TerminationGracePeriodSeconds
	}
	var err error
	switch h := in.ProbeHandler; {
	case h.Exec != nil && len(h.Exec.Command) > 0:
		s.Exec = append([]string{}, h.Exec.Command...)
	case h.HTTPGet != nil:
		s.HTTP = &probe.HTTP{Scheme: string(h.HTTPGet.Scheme), Host: h.HTTPGet.Host, Path: h.HTTPGet.Path}
		if s.HTTP.Port, err = portNumber(vm, h.HTTPGet.Port); err != nil {
			return nil, err
		}
		if s.HTTP.Scheme != "" && s.HTTP.Scheme != string(corev1.URISchemeHTTP) && s.HTTP.Scheme != string(corev1.URISchemeHTTPS) {
			return nil, fmt.Errorf("httpGet.scheme %q: want HTTP or HTTPS", s.HTTP.Scheme)
		}
		for _, hd := range h.HTTPGet.HTTPHeaders {
			if hd.Name == "" || strings.ContainsAny(hd.Name+hd.Value, "\r\n\x00") {
				return nil, fmt.Errorf("httpGet.httpHeaders: a header %q that HTTP cannot carry", hd.Name)
			}
			s.HTTP.Headers = append(s.HTTP.Headers, probe.Header{Name: hd.Name, Value: hd.Value})
		}
	case h.TCPSocket != nil:
		s.TCP = &probe.TCP{Host: h.TCPSocket.Host}
		if s.TCP.Port, err = portNumber(vm, h.TCPSocket.Port); err != nil {
			return nil, err
		}
	case h.GRPC != nil:
		s.GRPC = &probe.GRPC{Port: int(h.GRPC.Port)}
		if h.GRPC.Service != nil {
			s.GRPC.Service = *h.GRPC.Service
		}
		if s.GRPC.Port < 1 || s.GRPC.Port > 65535 {
			return nil, fmt.Errorf("grpc.port %d: want 1 to 65535", s.GRPC.Port)
		}
	default:
		return nil, fmt.Errorf("no handler: set one of exec, httpGet, tcpSocket and grpc")
	}
	return s, nil
}

func orDefault(v, d int32) int32 {
	if v <= 0 {
		return d
	}
	return v
}

// portNumber is p as a number: itself, or the port of spec.ports it names.
func portNumber(vm *impv1.ImpVM, p intstr.IntOrString) (int, error) {
	if p.Type == intstr.Int {
		if p.IntVal < 1 || p.IntVal > 65535 {
			return 0, fmt.Errorf("port %d: want 1 to 65535", p.IntVal)
		}
		return int(p.IntVal), nil
	}
	for _, vp := range vm.Spec.Ports {
		if vp.Name != "" && vp.Name == p.StrVal {
			return int(vp.Port), nil
		}
	}
	return 0, fmt.Errorf("port %q names no port of spec.ports", p.StrVal)
}
