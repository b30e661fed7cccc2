package access

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"

	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/cri-streaming/pkg/streaming/remotecommand"
	"k8s.io/streaming/pkg/httpstream/wsstream"
)

// WebSocketProtocol is the exec protocol kubectl speaks over WebSocket: v4's channels plus a
// signal that closes stdin, which v4 lacks (so a command reading to its input's end waits).
// The CRI streaming library serves v4 and older only.
const WebSocketProtocol = "v5.channel.k8s.io"

// The channels of remotecommand over WebSocket.
const (
	stdinChannel = iota
	stdoutChannel
	stderrChannel
	errorChannel
	resizeChannel
)

// session is an exec or an attachment as a stream protocol serves it: its streams (nil when
// not asked for) and the terminal's sizes (nil without a tty); an error that carries
// ExitStatus is the command's code.
type session func(ctx context.Context, in io.Reader, out, errOut io.WriteCloser, resize <-chan remotecommand.TerminalSize) error

// serveWebSocket runs an exec or attachment over one WebSocket: its frames are ordered, so
// the end of the output always precedes the exit status.
func serveWebSocket(w http.ResponseWriter, r *http.Request, log logr.Logger, o *remotecommand.Options, run session) {
	channels := []wsstream.ChannelType{wsstream.IgnoreChannel, wsstream.IgnoreChannel, wsstream.IgnoreChannel, wsstream.WriteChannel, wsstream.IgnoreChannel}
	if o.Stdin {
		channels[stdinChannel] = wsstream.ReadChannel
	}
	if o.Stdout {
		channels[stdoutChannel] = wsstream.WriteChannel
	}
	if o.Stderr && !o.TTY {
		channels[stderrChannel] = wsstream.WriteChannel
	}
	if o.TTY {
		channels[resizeChannel] = wsstream.ReadChannel
	}
	conn := wsstream.NewConn(map[string]wsstream.ChannelProtocolConfig{WebSocketProtocol: {Binary: true, Channels: channels}})
	conn.SetIdleTimeout(IdleTimeout)
	_, streams, err := conn.Open(w, r)
	if err != nil {
		log.Info("upgrading to a WebSocket", "error", err.Error())
		return
	}
	defer conn.Close()
	// An empty message on the lowest channel written tells the client the streams are ready,
	// as the CRI streaming library's v4 does.
	switch {
	case o.Stdout:
		_, _ = streams[stdoutChannel].Write(nil)
	case o.Stderr && !o.TTY:
		_, _ = streams[stderrChannel].Write(nil)
	default:
		_, _ = streams[errorChannel].Write(nil)
	}
	var in io.Reader
	var out, errOut io.WriteCloser
	if o.Stdin {
		in = streams[stdinChannel]
	}
	if o.Stdout {
		out = streams[stdoutChannel]
	}
	if o.Stderr && !o.TTY {
		errOut = streams[stderrChannel]
	}
	var resize chan remotecommand.TerminalSize
	if o.TTY {
		resize = make(chan remotecommand.TerminalSize, 1)
		go func() {
			defer close(resize)
			dec := json.NewDecoder(streams[resizeChannel])
			for {
				var sz remotecommand.TerminalSize
				if dec.Decode(&sz) != nil {
					return
				}
				select {
				case resize <- sz:
				case <-r.Context().Done():
					return
				}
			}
		}()
	}
	err = run(r.Context(), in, out, errOut, resize)
	st := metav1.Status{Status: metav1.StatusSuccess}
	var exit interface{ ExitStatus() int }
	switch {
	case errors.As(err, &exit):
		st = metav1.Status{Status: metav1.StatusFailure, Reason: remotecommand.NonZeroExitCodeReason,
			Message: fmt.Sprintf("command terminated with non-zero exit code: %v", err),
			Details: &metav1.StatusDetails{Causes: []metav1.StatusCause{{Type: remotecommand.ExitCodeCauseType, Message: strconv.Itoa(exit.ExitStatus())}}}}
	case err != nil:
		st = metav1.Status{Status: metav1.StatusFailure, Reason: metav1.StatusReasonInternalError, Code: http.StatusInternalServerError,
			Message: fmt.Sprintf("in the VM: %v", err)}
	}
	b, _ := json.Marshal(st)
	_, _ = streams[errorChannel].Write(b)
}
