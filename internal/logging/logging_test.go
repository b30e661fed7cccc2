package logging

import "testing"

func TestLogger(t *testing.T) {
	tests := []struct {
		name    string
		opts    Options
		wantErr bool
		debugOn bool
	}{
		{name: "defaults", opts: Options{Level: "info", Format: "json"}},
		{name: "debug text", opts: Options{Level: "debug", Format: "text"}, debugOn: true},
		{name: "verbosity number", opts: Options{Level: "4", Format: "json"}, debugOn: true},
		{name: "bad level", opts: Options{Level: "loud", Format: "json"}, wantErr: true},
		{name: "negative level", opts: Options{Level: "-1", Format: "json"}, wantErr: true},
		{name: "bad format", opts: Options{Level: "info", Format: "xml"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := tt.opts.Logger()
			if (err != nil) != tt.wantErr {
				t.Fatalf("error = %v, wantErr %v", err, tt.wantErr)
			}
			if err == nil && l.V(1).Enabled() != tt.debugOn {
				t.Errorf("V(1).Enabled() = %v, want %v", l.V(1).Enabled(), tt.debugOn)
			}
		})
	}
}
