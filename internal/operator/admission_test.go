package operator_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// The post-install wait admits once the API server takes ImpVM creates, under the operator's
// chart identity, and stores nothing; an identity that may not create ImpVMs waits in vain.
func TestWaitForAdmission(t *testing.T) {
	cl := testcluster.Require(t, shared)
	ctx := context.Background()
	as := func(component string) client.Client {
		c, err := client.New(cl.As(t, component), client.Options{Scheme: cl.Scheme})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	if err := operator.WaitForAdmission(ctx, as(testcluster.Operator), testcluster.ChartNamespace, time.Minute, logr.Discard()); err != nil {
		t.Fatalf("the operator's identity: %v", err)
	}
	var vms impv1.ImpVMList
	if err := cl.Client.List(ctx, &vms, client.InNamespace(testcluster.ChartNamespace)); err != nil || len(vms.Items) != 0 {
		t.Errorf("the wait left %d ImpVMs (%v): it must only dry-run", len(vms.Items), err)
	}
	err := operator.WaitForAdmission(ctx, as(testcluster.Agent), testcluster.ChartNamespace, 3*time.Second, logr.Discard())
	if err == nil || !strings.Contains(err.Error(), "forbidden") {
		t.Errorf("the agent's identity, which may not create ImpVMs: %v, want a refusal", err)
	}
}
