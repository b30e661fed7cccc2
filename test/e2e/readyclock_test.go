package e2e

import (
	"context"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
)

// readyClock records when the test first sees each ImpVM of a namespace, and each VM's volume
// holder pod, Ready: from watches, so a figure is as precise as an event's arrival rather than
// a poll of kubectl. Keys are "impvm/NAME" and "holder/VM".
type readyClock struct {
	mu sync.Mutex
	at map[string]time.Time
}

func (c *readyClock) ready(key string) (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.at[key]
	return at, ok
}

func watchReady(t *testing.T, kubeconfig, namespace string) *readyClock {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c := &readyClock{at: map[string]time.Time{}}
	follow := func(gvr schema.GroupVersionResource, selector string, key func(*unstructured.Unstructured) string) {
		for ctx.Err() == nil {
			w, err := dc.Resource(gvr).Namespace(namespace).Watch(ctx, metav1.ListOptions{LabelSelector: selector})
			if err != nil {
				time.Sleep(200 * time.Millisecond)
				continue
			}
			for ev := range w.ResultChan() {
				u, ok := ev.Object.(*unstructured.Unstructured)
				if !ok || ev.Type == watch.Deleted || !conditionTrue(u, "Ready") {
					continue
				}
				if k := key(u); k != "" {
					c.mu.Lock()
					if _, seen := c.at[k]; !seen {
						c.at[k] = time.Now()
					}
					c.mu.Unlock()
				}
			}
		}
	}
	go follow(schema.GroupVersionResource{Group: "imp.dev", Version: "v1alpha1", Resource: "impvms"}, "",
		func(u *unstructured.Unstructured) string { return "impvm/" + u.GetName() })
	go follow(schema.GroupVersionResource{Version: "v1", Resource: "pods"}, "imp.dev/volume-holder=true",
		func(u *unstructured.Unstructured) string {
			for _, o := range u.GetOwnerReferences() {
				if o.Kind == "ImpVM" {
					return "holder/" + o.Name
				}
			}
			return ""
		})
	return c
}

func conditionTrue(u *unstructured.Unstructured, kind string) bool {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		if m, ok := c.(map[string]any); ok && m["type"] == kind && m["status"] == "True" {
			return true
		}
	}
	return false
}
