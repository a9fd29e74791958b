#!/usr/bin/perl
# What pve-storage checks when it loads a custom plugin from
# /usr/share/perl5/PVE/Storage/Custom, and what `pvesm add` would refuse.

use strict;
use warnings;

use Test::MockModule;
use Test::More;

use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';

ok($plugin->isa('PVE::Storage::Plugin'), 'derives from PVE::Storage::Plugin');
is($plugin->type(), 'fewerbytes', 'type fewerbytes');

my $api = $plugin->api();
is($api, 15, 'claims the current storage API, 15');
cmp_ok($api, '<=', PVE::Storage::APIVER, 'not newer than the host');
cmp_ok($api, '>=', PVE::Storage::APIVER - PVE::Storage::APIAGE, 'within the age the host accepts');

{
    # On a Proxmox VE 8 host (storage API 11), the plugin claims 11 and loads.
    my $storage = Test::MockModule->new('PVE::Storage');
    $storage->redefine(APIVER => sub { 11 });
    is($plugin->api(), 11, 'on an older host it claims that host\'s version');
}

is_deeply($plugin->plugindata()->{content}, [{ images => 1 }, { images => 1 }],
    'content: images only, images by default');
is_deeply($plugin->plugindata()->{format}, [{ raw => 1 }, 'raw'], 'format: raw');

my $options = $plugin->options();
ok($options->{'fewerbytes-pool'}->{fixed}, 'the pool is fixed once added');
ok($options->{"fewerbytes-$_"}->{optional}, "fewerbytes-$_ is optional")
    for qw(socket control-socket);
ok(!$options->{shared}, 'not shared: the pool is on one host');
for my $property (keys $plugin->properties()->%*) {
    like($property, qr/^fewerbytes-/, "property $property cannot clash with another plugin's");
}

eval { $plugin->on_add_hook('fb', { content => { images => 1, rootdir => 1 } }) };
like($@, qr/VM disk images only; containers \(rootdir\)/, 'rootdir is refused, saying why');
eval { $plugin->on_add_hook('fb', { content => { images => 1 } }) };
is($@, '', 'images is accepted');

for my $volname (qw(vm-100-disk-0 base-100-disk-0 base-100-disk-0/vm-101-disk-3 vm-100-cloudinit
    vm-100-state-before_upgrade)) {
    my @parsed = eval { $plugin->parse_volname($volname) };
    is($@, '', "parses $volname");
}
is_deeply([$plugin->parse_volname('base-100-disk-0/vm-101-disk-3')],
    ['images', 'vm-101-disk-3', 101, 'base-100-disk-0', 100, undef, 'raw'],
    'a linked clone names its template and the template\'s VM');
is_deeply([$plugin->parse_volname('base-100-disk-0')],
    ['images', 'base-100-disk-0', 100, undef, undef, 1, 'raw'], 'a template is a base');
for my $bad ('disk0', 'vm-100-disk+0', 'vm-x-disk-0', 'vm-100-disk-0/vm-101-disk-0',
    'snap:s1:vm-100-disk-0') {
    eval { $plugin->parse_volname($bad) };
    like($@, qr/unable to parse fewerbytes volume name/, "refuses the volume name '$bad'");
}

done_testing();
