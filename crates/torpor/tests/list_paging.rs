//! `GET /v1/sandboxes` a page at a time (`limit`, `cursor`, the `x-next-cursor` header),
//! against the real daemon: the operator's pages hold every tenant's sandboxes exactly once,
//! a tenant's pages hold only its own (whatever cursor it sends), the body stays a JSON array,
//! and a bad limit or cursor is refused with its code.

mod common;

use std::collections::BTreeSet;

use common::{create, Daemon};
use torpor_api::types::CreateTenantBody;
use torpor_api::{Client, ClientError};

/// Every page of `c`'s list, `limit` at a time, following `x-next-cursor` to the last.
async fn pages(c: &Client, limit: usize) -> Vec<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let (page, next) = c
            .sandboxes_page(None, Some(limit), cursor.as_deref())
            .await
            .unwrap();
        assert!(page.len() <= limit, "{page:?}");
        out.push(page.into_iter().map(|s| (s.id, s.tenant)).collect());
        match next {
            Some(n) => cursor = Some(n),
            None => return out,
        }
        assert!(out.len() < 50, "paging never ends: {out:?}");
    }
}

fn refused(e: ClientError) -> (u16, String) {
    match e {
        ClientError::Api { status, code, .. } => (status, code),
        other => panic!("not an API refusal: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sandboxes_are_listed_in_pages_each_once_and_tenants_see_only_their_own() {
    let d = Daemon::start().await;
    let admin = d.client();
    let mut tenants = Vec::new();
    for name in ["team-a", "team-b"] {
        let t = admin
            .create_tenant(&CreateTenantBody {
                name: name.into(),
                quotas: None,
            })
            .await
            .unwrap();
        tenants.push(Client::new(&d.url(), &t.token));
    }
    let (a, b) = (&tenants[0], &tenants[1]);
    // Five sandboxes: two of the operator's, two of team-a's, one of team-b's, interleaved.
    let mut made = Vec::new();
    for (c, tenant) in [
        (&admin, "admin"),
        (a, "team-a"),
        (&admin, "admin"),
        (b, "team-b"),
        (a, "team-a"),
    ] {
        made.push((create(c, "host").await, tenant.to_string()));
    }

    // The operator: 2 + 2 + 1, each sandbox once, in creation order.
    let all = pages(&admin, 2).await;
    assert_eq!(
        all.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![2, 2, 1],
        "{all:?}"
    );
    assert_eq!(all.concat(), made, "every sandbox once, oldest first");
    // The client's whole list follows the pages too.
    let whole: Vec<String> = admin
        .sandboxes(None)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(
        whole,
        made.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>()
    );

    // A tenant's pages hold its own only.
    let own = |t: &str| -> Vec<(String, String)> {
        made.iter().filter(|(_, x)| x == t).cloned().collect()
    };
    let a_pages = pages(a, 1).await;
    assert_eq!(a_pages.concat(), own("team-a"), "{a_pages:?}");
    assert_eq!(pages(b, 1).await.concat(), own("team-b"));
    // A cursor from the operator's list only says where to start: team-b still sees only its
    // own sandboxes after it, nobody else's.
    let (_, op_cursor) = admin.sandboxes_page(None, Some(1), None).await.unwrap();
    let op_cursor = op_cursor.expect("more than one sandbox: a next page");
    let (from_there, _) = b
        .sandboxes_page(None, Some(10), Some(&op_cursor))
        .await
        .unwrap();
    let ids: BTreeSet<String> = from_there.into_iter().map(|s| s.id).collect();
    assert_eq!(
        ids,
        own("team-b").into_iter().map(|(id, _)| id).collect(),
        "after the first sandbox, team-b's own"
    );

    // The body is the JSON array it always was; the cursor is a header.
    let http = reqwest::Client::new();
    let resp = http
        .get(format!("{}/v1/sandboxes?limit=3", d.url()))
        .bearer_auth(d.token())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-next-cursor"));
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body.as_array().map(Vec::len), Some(3), "{body}");
    let last = http
        .get(format!("{}/v1/sandboxes", d.url()))
        .bearer_auth(d.token())
        .send()
        .await
        .unwrap();
    assert!(
        !last.headers().contains_key("x-next-cursor"),
        "one page holds all five at the default limit"
    );

    // Out of range or malformed: 400 with its code.
    for limit in [0, 10_001] {
        let e = admin
            .sandboxes_page(None, Some(limit), None)
            .await
            .unwrap_err();
        assert_eq!(refused(e), (400, "invalid_limit".to_string()), "{limit}");
    }
    for query in ["limit=two", "limit=-1", "limit="] {
        let resp = http
            .get(format!("{}/v1/sandboxes?{query}", d.url()))
            .bearer_auth(d.token())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{query}");
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_limit", "{query}: {v}");
    }
    // Not base64; "1:1" (no id); "2:1:x" (a version this API never wrote).
    for cursor in ["not a cursor!", "MTox", "MjoxOng"] {
        let e = a
            .sandboxes_page(None, Some(2), Some(cursor))
            .await
            .unwrap_err();
        assert_eq!(refused(e), (400, "invalid_cursor".to_string()), "{cursor}");
    }
}
