package main

import (
	"encoding/json"
	"net/http/httptest"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestHandlerCountsCalls(t *testing.T) {
	h := newHandler()
	for i := int64(1); i <= 3; i++ {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("POST", "/orders/7?x=1", nil))
		var got reply
		if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
			t.Fatal(err)
		}
		if want := (reply{Method: "POST", Path: "/orders/7", Call: i}); got != want || w.Code != 200 {
			t.Errorf("call %d: %d %+v, want 200 %+v", i, w.Code, got, want)
		}
	}
}
